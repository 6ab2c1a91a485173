"""A real CMP server for tests and the benchmark: OpenSSL's ``openssl cmp`` in mock-server mode, plus the test PKI
it needs (CA, server and client certificates as files) and an HTTP relay to put TLS or faults in front of it.

Usable from pytest and from a plain program::

    pki = TestPki.create(directory)
    with CmpMockServer(directory, "-srv_ref", "ca", "-srv_secret", "pass:s3cret",
                       "-rsp_cert", str(pki.write("issued.pem", certificate))) as server:
        ... connect to 127.0.0.1:server.port

The mock answers every request with its fixed ``-rsp_cert``, handles one connection at a time, and its ``genm``
answer echoes the request (no CA certificates). ``IssuingCmpServer`` puts a CA in front of it that certifies the key
each request asks for, one mock per transaction. ``refusing`` makes a relay turn chosen message types down, the way a
server that does not implement them does: an HTTP error page (``http_error``) or a CMP error message (forwarded to a
mock started with ``-send_error``). ``TrustpointLike`` answers as Trustpoint 0.6 does. ``BrokenTcpServer`` fails
connections the ways networks do, for the EST tests as much as the CMP ones.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import socket
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtensionOID
from pyasn1.codec.der import decoder, encoder
from pyasn1.type import char
from pyasn1_alt_modules import rfc2986, rfc4210, rfc5280, rfc9480

from tests.crypto_factory import DEVICE_KEY_USAGE, SERVER_AND_CLIENT, Credential, ec_key, host_names, make_ca
from tests.support import free_port, stop_process

CMP_CONTENT_TYPE = "application/pkixcmp"
# Django's page for an unhandled error with DEBUG off; the Django-based server of issue 10 answers genm with HTTP 500.
DJANGO_SERVER_ERROR = (
    b'\n<!doctype html>\n<html lang="en">\n<head>\n  <title>Server Error (500)</title>\n</head>\n<body>\n'
    b"  <h1>Server Error (500)</h1><p></p>\n</body>\n</html>\n"
)


def wait_for_port(port: int, timeout: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server for port {port} exited")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing accepted connections on 127.0.0.1:{port} within {timeout} s")


@dataclass
class TestPki:
    """A CA and what a CMP exchange needs from it, written as PEM files into ``directory`` on demand."""

    directory: Path
    ca_key: ec.EllipticCurvePrivateKey
    ca_certificate: x509.Certificate
    crl_url: str | None = None
    _serial: int = field(default=1000)

    __test__ = False  # not a pytest test class

    @classmethod
    def create(cls, directory: Path, common_name: str = "Plant CMP Test CA", crl_url: str | None = None) -> TestPki:
        directory.mkdir(parents=True, exist_ok=True)
        ca = make_ca(common_name, days=30)
        return cls(directory, ca.key, ca.certificate, crl_url)  # type: ignore[arg-type]

    @property
    def ca(self) -> Credential:
        return Credential(self.ca_certificate, self.ca_key)

    def issue(
        self,
        public_key,
        common_name: str,
        *,
        ca: bool = False,
        issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None = None,
        hosts: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
        days: int = 10,
    ) -> x509.Certificate:
        """A certificate for ``public_key``, signed by this CA (or by ``issuer``: an intermediate)."""
        self._serial += 1
        return Credential(*(issuer or (self.ca_certificate, self.ca_key))).issue(
            common_name,
            public_key,
            ca=ca,
            serial_number=self._serial,
            days=days,
            extended_key_usage=() if ca else SERVER_AND_CLIENT,
            san=host_names(*hosts, *ips),
            crl_url=self.crl_url,
            key_identifiers=True,
        )

    def answering(self, certificate: x509.Certificate, *extra_certificates: x509.Certificate) -> tuple[str, ...]:
        """A mock's arguments to answer with ``certificate`` (``-rsp_cert``), with ``extra_certificates`` in the
        extraCerts of its answers."""
        arguments = ("-rsp_cert", str(self.write(f"answer-{certificate.serial_number:x}.pem", certificate)))
        if extra_certificates:
            path = self.write(f"extra-{extra_certificates[0].serial_number:x}.pem", *extra_certificates)
            arguments += ("-rsp_extracerts", str(path))
        return arguments

    def trusted_signers(self) -> tuple[str, ...]:
        """A mock's arguments to accept requests signed by a certificate of this CA."""
        return ("-srv_trusted", str(self.write("trusted.pem", self.ca_certificate)))

    def tls_server_context(self) -> ssl.SSLContext:
        """A TLS server context for 127.0.0.1 with a certificate from this CA."""
        key = ec_key()
        certificate = self.issue(key.public_key(), "cmp-tls-relay", ips=("127.0.0.1",))
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.write("tls-relay.crt.pem", certificate), self.write("tls-relay.key.pem", key))
        return context

    def write(self, filename: str, *items) -> Path:
        """Certificates and keys as one PEM file (keys unencrypted: test material only)."""
        path = self.directory / filename
        chunks = []
        for item in items:
            if isinstance(item, x509.Certificate):
                chunks.append(item.public_bytes(serialization.Encoding.PEM))
            else:
                chunks.append(
                    item.private_bytes(
                        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                    )
                )
        path.write_bytes(b"".join(chunks))
        return path


class CmpMockServer:
    """``openssl cmp -port N <arguments>`` on 127.0.0.1; output to ``<directory>/cmp-mock-<port>.log``."""

    def __init__(self, directory: Path, *arguments: str, verbosity: int = 7) -> None:
        self.directory = directory
        self.arguments = list(arguments)
        self.verbosity = verbosity
        self.port = 0
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> CmpMockServer:
        self.port = free_port()
        self.log_path = self.directory / f"cmp-mock-{self.port}.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["openssl", "cmp", "-config", "", "-port", str(self.port), "-verbosity", str(self.verbosity),
                 *self.arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.directory,
            )  # fmt: skip
        try:
            wait_for_port(self.port, timeout, lambda: self.process is not None and self.process.poll() is None)
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{error}:\n{self.log()}") from None
        return self

    def stop(self) -> None:
        stop_process(self.process, 5)
        self.process = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def __enter__(self) -> CmpMockServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# An answer: body and content type, and the HTTP status when it is not 200.
Answer = tuple[bytes, str] | tuple[bytes, str, int]
Handler = Callable[[bytes], Awaitable[Answer]]


def body_type(request: bytes) -> str:
    """The body type of a DER PKIMessage (``p10cr``, ``certConf``, ...)."""
    message, _ = decoder.decode(request, asn1Spec=rfc9480.PKIMessage())
    return message["body"].getName()


class HttpRelay:
    """An aiohttp server on 127.0.0.1 whose ``handle(body) -> (body, content_type[, status])`` answers every POST:
    to forward to a mock (``forward_to``), terminate TLS in front of one, alter answers, refuse, or misbehave."""

    def __init__(self, handle: Handler, ssl_context: ssl.SSLContext | None = None) -> None:
        self.handle = handle
        self.ssl_context = ssl_context
        self.port = 0
        self.requests: list[bytes] = []
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def body_types(self) -> list[str]:
        """The body types of the requests received so far, in order."""
        return [body_type(request) for request in self.requests]

    async def _answer(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests.append(body)
        answer, content_type, *status = await self.handle(body)
        return web.Response(body=answer, status=status[0] if status else 200, headers={"Content-Type": content_type})

    async def start(self) -> HttpRelay:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # Started again after a stop, it answers where it did: what a PKI back from an outage looks like.
        self.port = self.port or free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self.ssl_context).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> HttpRelay:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


def forward_to(server: CmpMockServer | HttpRelay, path: str = "/") -> Handler:
    """A relay handler passing each request to ``server`` and its answer back unchanged."""

    async def handle(body: bytes) -> tuple[bytes, str]:
        # A new connection per request: the mock serves one connection at a time.
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.post(
                f"http://{server.address}{path}", data=body, headers={"Content-Type": CMP_CONTENT_TYPE}
            ) as response,
        ):
            return await response.read(), response.headers.get("Content-Type", "")

    return handle


def sleeping(seconds: float) -> Handler:
    """A relay handler that answers only after ``seconds``."""

    async def handle(body: bytes) -> tuple[bytes, str]:
        await asyncio.sleep(seconds)
        return b"", CMP_CONTENT_TYPE

    return handle


def http_error(status: int = 500, body: bytes = DJANGO_SERVER_ERROR, content_type: str = "text/html") -> Handler:
    """A relay handler answering every request with an HTTP error page (by default Django's 500)."""

    async def handle(request: bytes) -> Answer:
        return body, content_type, status

    return handle


def refusing(handle: Handler, refused: Iterable[str], refuse: Handler) -> Handler:
    """A relay handler passing requests of the body types in ``refused`` to ``refuse`` (``http_error``, or
    ``forward_to`` a mock started with ``-send_error``) and the others to ``handle``."""
    kinds = frozenset(refused)

    async def route(request: bytes) -> Answer:
        return await (refuse if body_type(request) in kinds else handle)(request)

    return route


def _crl_reason(details) -> str:
    """The CRL reason an rr's RevDetails names (its ASN.1 name), "" when it names none."""
    for extension in details["crlEntryDetails"]:
        if extension["extnID"] == rfc5280.id_ce_cRLReasons:
            reason, _ = decoder.decode(bytes(extension["extnValue"]), asn1Spec=rfc5280.CRLReason())
            return reason.prettyPrint()
    return ""


def _subject(rdn_sequence) -> x509.Name:
    """A pyasn1 RDNSequence as a ``cryptography`` Name (attribute values as text)."""
    rdns = []
    for rdn in rdn_sequence:
        attributes = []
        for attribute in rdn:
            value, _ = decoder.decode(bytes(attribute["value"]))
            attributes.append(x509.NameAttribute(x509.ObjectIdentifier(str(attribute["type"])), str(value)))
        rdns.append(x509.RelativeDistinguishedName(attributes))
    return x509.Name(rdns)


@dataclass(frozen=True)
class CertificationRequest:
    """What a CMP certificate request asks for: subject, public key and subject alternative names (DER)."""

    subject: x509.Name
    public_key: CertificatePublicKeyTypes
    san: bytes | None


def requested(message: rfc9480.PKIMessage) -> CertificationRequest:
    """The subject, key and SAN of a p10cr (its CSR) or an ir, cr or kur (its CertTemplate)."""
    kind = message["body"].getName()
    if kind == "p10cr":
        request = rfc2986.CertificationRequest()
        for name in ("certificationRequestInfo", "signatureAlgorithm", "signature"):
            request[name] = message["body"]["p10cr"][name]
        csr = x509.load_der_x509_csr(encoder.encode(request))
        try:
            san = csr.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME).value.public_bytes()
        except x509.ExtensionNotFound:
            san = None
        return CertificationRequest(csr.subject, csr.public_key(), san)
    template = message["body"][kind][0]["certReq"]["certTemplate"]
    spki = rfc5280.SubjectPublicKeyInfo()
    spki["algorithm"] = template["publicKey"]["algorithm"]
    spki["subjectPublicKey"] = template["publicKey"]["subjectPublicKey"]
    san = next(
        (
            bytes(extension["extnValue"])
            for extension in template["extensions"]
            if str(extension["extnID"]) == ExtensionOID.SUBJECT_ALTERNATIVE_NAME.dotted_string
        ),
        None,
    )
    public_key = serialization.load_der_public_key(encoder.encode(spki))
    return CertificationRequest(_subject(template["subject"]["rdnSequence"]), public_key, san)


class IssuingCmpServer:
    """A CA behind ``openssl cmp``: for each certificate request (p10cr, ir, cr, kur) it certifies the requested
    subject, key and SAN, with the PKI's CRL distribution point, and starts a mock that answers that transaction with
    the certificate as ``-rsp_cert`` (OpenSSL's mock can only return a fixed one); the transaction's later messages
    (certConf, pollReq) go to the same mock, so OpenSSL checks the protection, POPO and confirmation as ever. An rr
    of a certificate it certified goes to a mock answering with that certificate, which OpenSSL's mock then revokes
    (it grants an rr only for its own ``-rsp_cert``, by issuer and serial; one it revoked before it rejects with
    failInfo certRevoked): ``revoked`` lists their serials,
    ``revocation_reasons`` the CRL reason each granted rr named (its ASN.1 name, ``cessationOfOperation``). Other
    requests (genm, any other rr) go to a standing mock. ``arguments`` are the mocks' (protection); ``chain_option``
    how they hand out the CA certificate (``-rsp_capubs`` reaches ip answers only). ``handle`` is the relay handler;
    ``issued`` what was certified. Every mock runs until ``stop``."""

    def __init__(self, pki: TestPki, *arguments: str, chain_option: str = "-rsp_capubs") -> None:
        self.pki = pki
        self.arguments = [*arguments, chain_option, str(pki.write("issuing-ca.pem", pki.ca_certificate))]
        self.issued: list[x509.Certificate] = []
        self.revoked: list[int] = []
        self.revocation_reasons: dict[int, str] = {}
        self._issued_files: dict[int, Path] = {}
        self._transactions: dict[bytes, CmpMockServer] = {}
        self._standing: CmpMockServer | None = None
        self._started: list[CmpMockServer] = []

    def certify(self, request: CertificationRequest) -> x509.Certificate:
        # The request's SAN goes into the certificate as the requester encoded it.
        san = x509.UnrecognizedExtension(ExtensionOID.SUBJECT_ALTERNATIVE_NAME, request.san) if request.san else None
        certificate = self.pki.ca.issue(
            request.subject,
            request.public_key,
            ca=False,
            days=30,
            key_usage=DEVICE_KEY_USAGE,
            extended_key_usage=SERVER_AND_CLIENT,
            crl_url=self.pki.crl_url,
            key_identifiers=True,
            extensions=(san,) if san else (),
        )
        self.issued.append(certificate)
        return certificate

    async def _start_mock(self, *arguments: str) -> CmpMockServer:
        # Started in a thread: starting waits for the port, which would stall every coroutine of this loop.
        mock = await asyncio.to_thread(CmpMockServer(self.pki.directory, *self.arguments, *arguments).start)
        self._started.append(mock)
        return mock

    async def handle(self, request: bytes) -> Answer:
        message, _ = decoder.decode(request, asn1Spec=rfc9480.PKIMessage())
        kind = message["body"].getName()
        transaction_id = bytes(message["header"]["transactionID"])
        if kind in ("p10cr", "ir", "cr", "kur"):
            certificate = self.certify(requested(message))
            path = self.pki.write(f"issued-{len(self.issued)}.pem", certificate)
            self._issued_files[certificate.serial_number] = path
            self._transactions[transaction_id] = await self._start_mock("-rsp_cert", str(path))
        revoking = None
        if kind == "rr":
            revoking = int(message["body"]["rr"][0]["certDetails"]["serialNumber"])
            if revoking in self._issued_files:
                # A CA keeps what it revoked: an rr of it again is rejected, failInfo certRevoked (RFC 4210 §5.2.3).
                already = ("-pkistatus", "2", "-failure", "10", "-statusstring", "certificate already revoked")
                self._transactions[transaction_id] = await self._start_mock(
                    "-rsp_cert", str(self._issued_files[revoking]), *(already if revoking in self.revoked else ())
                )
        mock = self._transactions.get(transaction_id)
        if mock is None:
            if self._standing is None:
                self._standing = await self._start_mock(
                    "-rsp_cert", str(self.pki.write("ca.pem", self.pki.ca_certificate))
                )
            mock = self._standing
        answer = await forward_to(mock)(request)
        if revoking in self._issued_files:
            response, _ = decoder.decode(answer[0], asn1Spec=rfc9480.PKIMessage())
            # PKIStatus 0 is "accepted": the mock granted the revocation.
            if response["body"].getName() == "rp" and int(response["body"]["rp"]["status"][0]["status"]) == 0:
                self.revoked.append(revoking)
                self.revocation_reasons[revoking] = _crl_reason(message["body"]["rr"][0])
        return answer

    def issue_from(self, authority: Credential, *above: x509.Certificate) -> None:
        """Certify with ``authority`` from now on (the new root of a key update, or an issuing CA under a root:
        ``above`` are its issuers up to the root), its certificate and ``above`` handed out as the chain by the mocks
        started from now on."""
        self.pki.ca_key, self.pki.ca_certificate = authority.key, authority.certificate  # type: ignore[assignment]
        self.pki.write("issuing-ca.pem", authority.certificate, *above)
        self.pki.write("ca.pem", authority.certificate)

    def stop(self) -> None:
        for mock in self._started:
            mock.stop()
        self._started.clear()
        self._transactions.clear()
        self._standing = None


@dataclass(frozen=True)
class RootKeyUpdate:
    """A new root CA key and the RFC 4210 §4.4 certificates that announce it: ``new`` (NewWithNew with its key),
    ``new_with_old`` and ``old_with_new``."""

    new: Credential
    new_with_old: x509.Certificate
    old_with_new: x509.Certificate

    @classmethod
    def of(cls, old: Credential, common_name: str = "Plant CMP Test CA", *, broken_link: bool = False) -> RootKeyUpdate:
        """A successor of the root ``old`` (valid longer, as a successor is); ``broken_link`` signs newWithOld with
        a stranger's key under the old root's name, as a forger would have to."""
        new = make_ca(common_name, days=60)
        signer = Credential(old.certificate, ec_key()) if broken_link else old
        options = {"ca": True, "days": 60, "key_identifiers": True}
        return cls(
            new,
            signer.issue(new.certificate.subject, new.key.public_key(), **options),
            new.issue(old.certificate.subject, old.key.public_key(), **options),  # type: ignore[union-attr]
        )


class RootCaKeyUpdateAnswer:
    """A relay handler answering genm id-it-rootCaCert (RFC 9483 §4.3.2) as an OpenSSL 3.2+ server does, which the
    3.0 mock on this machine cannot (it echoes a genm's items back): a genp with id-it-rootCaKeyUpdate carrying
    ``update`` (or, None, without a value: no update), MAC-protected with ``secret`` under the request's
    PasswordBasedMac parameters, computed here from RFC 4210 §5.1.3.1 rather than with certlm's code. Other requests
    go to ``handle`` (an ``IssuingCmpServer``'s: the enrollments stay OpenSSL's). ``without`` leaves fields of the
    update out (``newWithOld``); ``asked`` lists the root certificates the requests named."""

    def __init__(self, handle: Handler, secret: str, sender: x509.Name, update: RootKeyUpdate | None = None) -> None:
        self.handle = handle
        self.secret = secret.encode()
        self.sender = sender
        self.update = update
        self.without: set[str] = set()
        self.asked: list[x509.Certificate | None] = []
        # The CA certificates a genm id-it-caCerts (RFC 9483 §4.3.1) is answered with, when set; else that genm goes
        # to ``handle`` (OpenSSL 3.0's mock echoes it: no certificates).
        self.ca_certs: list[x509.Certificate] | None = None

    async def __call__(self, request: bytes) -> Answer:
        message, _ = decoder.decode(request, asn1Spec=rfc9480.PKIMessage())
        items = list(message["body"]["genm"]) if message["body"].getName() == "genm" else []
        if self.ca_certs is not None and any(item["infoType"] == rfc9480.id_it_caCerts for item in items):
            return self._genp(message, self._ca_certs_item()), CMP_CONTENT_TYPE
        if not any(item["infoType"] == rfc9480.id_it_rootCaCert for item in items):
            return await self.handle(request)
        value = items[0]["infoValue"]
        self.asked.append(x509.load_der_x509_certificate(bytes(value)) if value.isValue else None)
        return self._genp(message, self._root_ca_key_update_item()), CMP_CONTENT_TYPE

    def _ca_certs_item(self) -> rfc9480.InfoTypeAndValue:
        item = rfc9480.InfoTypeAndValue()
        item["infoType"] = rfc9480.id_it_caCerts
        value = rfc9480.CaCertsValue()
        for certificate in self.ca_certs or ():
            decoded, _ = decoder.decode(
                certificate.public_bytes(serialization.Encoding.DER), asn1Spec=rfc9480.CMPCertificate()
            )
            value.append(decoded)
        item["infoValue"] = encoder.encode(value)
        return item

    def _genp(self, request: rfc9480.PKIMessage, item: rfc9480.InfoTypeAndValue) -> bytes:
        answer = rfc9480.PKIMessage()
        header = answer["header"]
        header["pvno"] = 2
        sender, _ = decoder.decode(self.sender.public_bytes(), asn1Spec=rfc5280.Name())
        header["sender"]["directoryName"]["rdnSequence"] = sender["rdnSequence"]
        header["recipient"] = request["header"]["sender"]
        header["messageTime"] = time.strftime("%Y%m%d%H%M%SZ", time.gmtime())
        header["protectionAlg"] = request["header"]["protectionAlg"]
        header["transactionID"] = bytes(request["header"]["transactionID"])
        header["senderNonce"] = secrets.token_bytes(16)
        header["recipNonce"] = bytes(request["header"]["senderNonce"])
        answer["body"]["genp"].append(item)
        part = rfc9480.ProtectedPart()
        part["header"] = answer["header"]
        part["body"] = answer["body"]
        protection = password_based_mac_value(self.secret, password_based_mac(request), encoder.encode(part))
        schema = answer.componentType.getTypeByPosition(answer.componentType.getPositionByName("protection"))
        answer["protection"] = schema.clone(hexValue=protection.hex())
        return encoder.encode(answer)

    def _root_ca_key_update_item(self) -> rfc9480.InfoTypeAndValue:
        item = rfc9480.InfoTypeAndValue()
        item["infoType"] = rfc9480.id_it_rootCaKeyUpdate
        if self.update is not None:
            value = rfc9480.RootCaKeyUpdateValue()
            certificates = {
                "newWithNew": self.update.new.certificate,
                "newWithOld": self.update.new_with_old,
                "oldWithNew": self.update.old_with_new,
            }
            for name, certificate in certificates.items():
                if name in self.without:
                    continue
                der = certificate.public_bytes(serialization.Encoding.DER)
                decoded, _ = decoder.decode(der, asn1Spec=rfc9480.CMPCertificate())
                field = value[name]
                for part in ("tbsCertificate", "signatureAlgorithm", "signature"):
                    field[part] = decoded[part]
            item["infoValue"] = encoder.encode(value)
        return item


# RFC 4210 §5.1.3.1's one-way functions and MACs, by OID, as the test servers compute them.
_HASHES = {"2.16.840.1.101.3.4.2.1": "sha256", "1.3.14.3.2.26": "sha1"}
_HMACS = {"1.2.840.113549.2.9": "sha256", "1.3.6.1.5.5.8.1.2": "sha1"}


def password_based_mac_value(secret: bytes, parameters: rfc4210.PBMParameter | None, data: bytes) -> bytes:
    """PasswordBasedMac over ``data``: the key is the one-way function iterated over secret and salt, then the MAC."""
    assert parameters is not None, "the request is not protected with PasswordBasedMac"
    key = secret + bytes(parameters["salt"])
    for _ in range(int(parameters["iterationCount"])):
        key = hashlib.new(_HASHES[str(parameters["owf"]["algorithm"])], key).digest()
    return hmac.new(key, data, _HMACS[str(parameters["mac"]["algorithm"])]).digest()


# What Trustpoint 0.6 takes (its trustpoint_core.oid): the PasswordBasedMac MACs of HmacAlgorithm, all under the IPsec
# arc 1.3.6.1.5.5.8.1 or the SHA-3 HMACs, and the one-way functions of HashAlgorithm. RFC 9481's HMAC-SHA256
# (1.2.840.113549.2.9) is not among them.
TRUSTPOINT_MACS = frozenset(
    {f"1.3.6.1.5.5.8.1.{n}" for n in (1, 2, 4, 5, 6, 7)} | {f"2.16.840.1.101.3.4.2.{n}" for n in (13, 14, 15, 16)}
)
TRUSTPOINT_ONE_WAY_FUNCTIONS = frozenset(
    {"1.2.840.113549.2.5", "1.3.14.3.2.26"} | {f"2.16.840.1.101.3.4.2.{n}" for n in (1, 2, 3, 4, 7, 8, 9, 10, 11, 12)}
)
TRUSTPOINT_BODIES = frozenset({"ir", "cr", "rr", "certConf", "pollReq"})
# What its CMP endpoint answers, as text/plain with HTTP 500, when it cannot build a CMP answer.
TRUSTPOINT_SERVER_ERROR = b"An error occurred processing the CMP request."
TRUSTPOINT_MAC_REFUSAL = "CMP shared secret authentication failed: hmac algorithm not supported."


class TrustpointLike:
    """A relay handler that answers as Trustpoint 0.6's CMP endpoint does (from its source: the request pipeline's
    ``request/authentication/cmp.py`` and ``request/message_responder/cmp.py``), in front of ``handle`` (an
    ``IssuingCmpServer``'s) for what it takes:

    - A body type other than ir, cr, rr, certConf and pollReq (genm, p10cr, kur): HTTP 500, text/plain.
    - A PasswordBasedMac request whose MAC or one-way function is not in Trustpoint's tables: a CMP error message,
      rejection, "CMP shared secret authentication failed: hmac algorithm not supported.". Trustpoint builds it with
      the request's protectionAlg in its header but, having no shared secret after the failed authentication, signs
      it with its issuing CA's key (``signer``): no client can verify it.
    - The body types in ``signed_errors``: such a signed error too (Trustpoint's answer when a later stage fails).
    - ``fail_info``: a failInfo bit its error messages carry (Trustpoint's carry none).

    ``requests`` are the requests seen, for the MAC identifiers each used (``mac_oid``)."""

    def __init__(
        self,
        handle: Handler,
        signer: Credential,
        *,
        signed_errors: Iterable[str] = (),
        fail_info: str | None = None,
    ) -> None:
        self.handle = handle
        self.signer = signer
        self.signed_errors = frozenset(signed_errors)
        self.fail_info = fail_info
        self.requests: list[rfc9480.PKIMessage] = []

    async def __call__(self, request: bytes) -> Answer:
        message, _ = decoder.decode(request, asn1Spec=rfc9480.PKIMessage())
        self.requests.append(message)
        kind = message["body"].getName()
        if kind in self.signed_errors:
            return self.signed_error(message, TRUSTPOINT_SERVER_ERROR.decode()), CMP_CONTENT_TYPE
        if kind not in TRUSTPOINT_BODIES:
            return TRUSTPOINT_SERVER_ERROR, "text/plain", 500
        parameters = password_based_mac(message)
        if parameters is not None and (
            str(parameters["mac"]["algorithm"]) not in TRUSTPOINT_MACS
            or str(parameters["owf"]["algorithm"]) not in TRUSTPOINT_ONE_WAY_FUNCTIONS
        ):
            return self.signed_error(message, TRUSTPOINT_MAC_REFUSAL), CMP_CONTENT_TYPE
        return await self.handle(request)

    def signed_error(self, request: rfc9480.PKIMessage, text: str) -> bytes:
        """An error message answering ``request``, its header naming the request's protection, signed with the CA."""
        answer = rfc9480.PKIMessage()
        header = answer["header"]
        header["pvno"] = 2
        sender, _ = decoder.decode(self.signer.certificate.subject.public_bytes(), asn1Spec=rfc5280.Name())
        header["sender"]["directoryName"]["rdnSequence"] = sender["rdnSequence"]
        header["recipient"] = request["header"]["sender"]
        header["messageTime"] = time.strftime("%Y%m%d%H%M%SZ", time.gmtime())
        header["protectionAlg"]["algorithm"] = request["header"]["protectionAlg"]["algorithm"]
        if request["header"]["protectionAlg"]["parameters"].isValue:
            header["protectionAlg"]["parameters"] = request["header"]["protectionAlg"]["parameters"]
        header["senderKID"] = x509.SubjectKeyIdentifier.from_public_key(self.signer.key.public_key()).digest
        header["transactionID"] = bytes(request["header"]["transactionID"])
        header["senderNonce"] = secrets.token_bytes(16)
        header["recipNonce"] = bytes(request["header"]["senderNonce"])
        status = answer["body"]["error"]["pKIStatusInfo"]
        status["status"] = 2
        status["statusString"].append(char.UTF8String(text))
        if self.fail_info is not None:
            status["failInfo"] = rfc9480.PKIFailureInfo(self.fail_info)
        part = rfc9480.ProtectedPart()
        part["header"] = answer["header"]
        part["body"] = answer["body"]
        signature = self.signer.key.sign(encoder.encode(part), ec.ECDSA(hashes.SHA256()))
        schema = answer.componentType.getTypeByPosition(answer.componentType.getPositionByName("protection"))
        answer["protection"] = schema.clone(hexValue=signature.hex())
        certificate, _ = decoder.decode(
            self.signer.certificate.public_bytes(serialization.Encoding.DER), asn1Spec=rfc9480.CMPCertificate()
        )
        answer["extraCerts"].append(certificate)
        return encoder.encode(answer)


def password_based_mac(message: rfc9480.PKIMessage) -> rfc4210.PBMParameter | None:
    """The PasswordBasedMac parameters protecting ``message``; None for another protection."""
    algorithm = message["header"]["protectionAlg"]
    if not algorithm.isValue or algorithm["algorithm"] != rfc4210.id_PasswordBasedMac:
        return None
    return decoder.decode(bytes(algorithm["parameters"]), asn1Spec=rfc4210.PBMParameter())[0]


def mac_oid(message: rfc9480.PKIMessage) -> str | None:
    """The MAC identifier of a PasswordBasedMac-protected message (``1.3.6.1.5.5.8.1.2``)."""
    parameters = password_based_mac(message)
    return None if parameters is None else str(parameters["mac"]["algorithm"])
