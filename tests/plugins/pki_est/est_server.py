"""An EST (RFC 7030) server for tests and the benchmark: aiohttp over TLS on 127.0.0.1, certificates signed with
the internal CA plugin's functions, and every misbehaviour certlm must survive switchable between requests, redirects
included (a second listener on another port is another web origin).

    server = EstTestServer(directory)
    await server.start()
    ... server.url, server.tls_ca_pem, server.username, server.password, server.client_pkcs12_base64 ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import secrets
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aiohttp import web
from certlm_pki_internal import ca
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.serialization import pkcs7, pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID
from pyasn1.codec.der import decoder, encoder
from pyasn1.type import univ
from pyasn1_alt_modules import rfc7030

from certlm import CLIENT_PROFILE, SERVER_PROFILE, APIError
from tests.crypto_factory import Credential, certificate, ec_key, host_names, name

CERTS_ONLY = "application/pkcs7-mime; smime-type=certs-only"
ENROLL_OPERATIONS = ("simpleenroll", "simplereenroll", "serverkeygen")
# Who must authenticate how, per operation: none, basic, certificate, either or both.
DEFAULT_AUTH = {"cacerts": "none", "csrattrs": "none"} | dict.fromkeys(ENROLL_OPERATIONS, "either")
SIGNATURE_ALGORITHMS = {
    "1.2.840.10045.4.3.2", "1.2.840.10045.4.3.3", "1.2.840.10045.4.3.4",
    "1.2.840.113549.1.1.11", "1.2.840.113549.1.1.12", "1.2.840.113549.1.1.13",
}  # fmt: skip
FAILURES = ("truncated", "content-type", "garbage", "slow", "500", "foreign-certificate")


@dataclass
class SeenRequest:
    """What the server saw of one request, for tests to assert on: ``operation`` is None for a path that is no EST
    operation (a scripted redirect), ``url`` names the listener it reached (origin and path, without the query),
    ``authorization`` whether any Authorization header came."""

    operation: str | None
    basic_user: str | None
    client_certificate: x509.Certificate | None
    content_type: str | None
    url: str
    authorization: bool
    method: str


@dataclass(frozen=True)
class _Authority(Credential):
    crl_name: str = ""


@dataclass(frozen=True)
class RootKeyUpdate:
    """The four certificates of a root CA key update (RFC 4210 §4.4), which ``/cacerts`` serves beside the current
    chain once announced: the old root (OldWithOld), the new root (NewWithNew, with its key as ``new``), the new key
    certified by the old (NewWithOld) and the old key certified by the new (OldWithNew)."""

    old: _Authority
    new: _Authority
    new_with_old: x509.Certificate
    old_with_new: x509.Certificate
    # The new issuing CA under the new root, for a server started with an intermediate.
    new_issuing: _Authority | None = None

    @property
    def certificates(self) -> list[x509.Certificate]:
        issuing = [self.new_issuing.certificate] if self.new_issuing else []
        return [self.old.certificate, self.old_with_new, self.new_with_old, self.new.certificate, *issuing]


def _name(common_name: str) -> x509.Name:
    return name(common_name, organization="EST Test")


def _certificate(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: _Authority | None,
    *,
    is_ca: bool,
    cdp: str | None = None,
    hosts: tuple[str, ...] = (),
    days: int | None = None,
) -> x509.Certificate:
    """A CA or TLS server certificate; ``issuer`` None makes it self-signed."""
    options = {
        "ca": is_ca,
        "days": days or (30 if is_ca else 20),
        "extended_key_usage": () if is_ca else (ExtendedKeyUsageOID.SERVER_AUTH,),
        "san": host_names(*hosts),
        "crl_url": cdp,
        "key_identifiers": True,
    }
    if issuer is None:
        return certificate(subject, key.public_key(), key, **options)
    return issuer.issue(subject, key.public_key(), **options)


def _pem(certificates: list[x509.Certificate]) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in certificates)


def csr_attributes_der(*oids: str, ec_curve: str | None = None, extensions: tuple[str, ...] = ()) -> bytes:
    """A DER ``CsrAttrs``: bare OIDs (signature algorithms, attribute types), an ecPublicKey attribute naming
    ``ec_curve`` and an extensionRequest attribute listing extension OIDs, as in RFC 7030 §4.5.2's example."""
    attributes = rfc7030.CsrAttrs()
    for oid in oids:
        item = rfc7030.AttrOrOID()
        item["oid"] = univ.ObjectIdentifier(oid)
        attributes.append(item)
    for attribute_type, values in (
        ("1.2.840.10045.2.1", [ec_curve] if ec_curve else []),
        ("1.2.840.113549.1.9.14", list(extensions)),
    ):
        if not values:
            continue
        item = rfc7030.AttrOrOID()
        item["attribute"]["attrType"] = univ.ObjectIdentifier(attribute_type)
        for value in values:
            item["attribute"]["attrValues"].append(univ.Any(encoder.encode(univ.ObjectIdentifier(value))))
        attributes.append(item)
    return encoder.encode(attributes)


class EstTestServer:
    """An EST server with an EST CA (optionally root plus issuing intermediate), its own TLS CA for the HTTPS
    certificate, a plain-HTTP CRL distribution point, HTTP basic and TLS client certificate authentication.
    ``tls=False`` serves EST over plain HTTP instead (what ``http://host:port`` in ``pki_connection`` is for).

    Attributes tests may change between requests: ``auth`` (per operation), ``serverkeygen`` and
    ``serverkeygen_refusal``, ``csr_attributes`` (DER CsrAttrs or None) and ``enforce_csr_attributes``,
    ``pending`` (how many 202 answers come first) and ``retry_after``, ``failure`` (one of ``FAILURES``, for
    the enrollment operations) and ``slow_seconds``, ``single_line_base64``, ``shuffle`` (PKCS#7 order),
    ``enroll_includes_chain``. ``requests`` lists what came in.

    Root CA key update: ``announce_new_root`` adds the RFC 7030 §4.1.3 rollover certificates to ``/cacerts`` (a
    forged NewWithOld with ``broken_link``), with a new issuing CA under the new root for a server started with an
    intermediate; ``issue_from_new_root`` switches issuance to the new root (or that issuing CA). A new issuing CA
    under the same root: ``announce_new_issuing_ca`` adds it to ``/cacerts``, ``issue_from_new_issuing_ca`` switches
    issuance to it; ``/cacerts`` goes on serving the previous one, as a server does while its certificates live.

    Redirects: ``trailing_slash=True`` publishes the EST paths with a trailing slash and answers the path without it
    with ``slash_redirect_status`` (301, or 308) and a relative Location, as some EST servers do. ``mirror=True``
    starts a second listener of the same server on another port (``mirror_origin``, ``mirror_url``), with its own
    TLS certificate from the TLS CA (or, ``mirror_tls_trusted=False``, from a CA no one trusts), revoked by the TLS
    CA's CRL while ``mirror_tls_certificate_revoked``. ``redirects`` maps a URL (origin and path, and the query
    when one is sent) on either listener to the Location it answers with ``redirect_status``.
    """

    def __init__(
        self,
        directory: Path,
        *,
        path_segment: str | None = None,
        intermediate: bool = False,
        tls_issued_by_est_ca: bool = False,
        tls: bool = True,
        trailing_slash: bool = False,
        mirror: bool = False,
        mirror_tls_trusted: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.tls = tls
        self.trailing_slash = trailing_slash
        self.mirror = mirror
        self.mirror_tls_trusted = mirror_tls_trusted
        self.slash_redirect_status = 301
        self.redirects: dict[str, str] = {}
        self.redirect_status = 307
        self.mirror_tls_certificate_revoked = False
        self.path_segment = path_segment.strip("/") if path_segment else None
        self.intermediate = intermediate
        self.tls_issued_by_est_ca = tls_issued_by_est_ca
        self.username = "est-ra"
        self.password = secrets.token_urlsafe(12)
        self.client_pkcs12_password = secrets.token_urlsafe(12)
        self.auth = dict(DEFAULT_AUTH)
        self.serverkeygen = True
        self.serverkeygen_refusal = 501
        self.csr_attributes: bytes | None = None
        self.enforce_csr_attributes = False
        self.pending = 0
        self.retry_after = "1"
        self.failure: str | None = None
        self.slow_seconds = 5.0
        self.single_line_base64 = False
        self.shuffle = False
        self.enroll_includes_chain = True
        # The profile of a server that keeps only the URI of the subject alternative names asked for.
        self.uri_san_only = False
        self.tls_certificate_revoked = False
        # A root CA key update (RFC 7030 §4.1.3): ``announce_new_root``, then ``issue_from_new_root``.
        self.rollover: RootKeyUpdate | None = None
        # A new issuing CA under the same root: ``announce_new_issuing_ca``, then ``issue_from_new_issuing_ca``.
        self.new_issuing_ca: _Authority | None = None
        self.previous_issuing_ca: _Authority | None = None
        # Every EST CA by the name of its CRL at the distribution point, the old ones kept after a rollover.
        self._authorities: dict[str, _Authority] = {}
        self.requests: list[SeenRequest] = []
        self.issued: list[x509.Certificate] = []
        self._crls: dict[tuple[bytes, tuple[int, ...]], x509.CertificateRevocationList] = {}
        self.port = 0
        self.mirror_port = 0
        self.cdp_port = 0
        self._runners: list[web.AppRunner] = []
        self._cdp_runner: web.AppRunner | None = None

    # ----- life cycle

    async def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cdp_runner = await self._serve(self._cdp_app(), None)
        self.cdp_port = self._cdp_runner.addresses[0][1]
        self._make_pki()
        chain = [
            self.tls_certificate,
            self.issuing.certificate if self.tls_issued_by_est_ca else self.tls_ca.certificate,
        ]
        runner = await self._serve(self._est_app(), self._server_tls("est", chain, self._tls_key) if self.tls else None)
        self.port = runner.addresses[0][1]
        if self.mirror:
            mirror_tls = self._server_tls(
                "mirror", [self.mirror_tls_certificate, self._mirror_issuer], self._mirror_key
            )
            self.mirror_port = (await self._serve(self._est_app(), mirror_tls if self.tls else None)).addresses[0][1]

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()

    async def stop_cdp(self) -> None:
        """Take the CRL distribution point off the network (its URLs stay in the certificates)."""
        if self._cdp_runner is not None:
            self._runners.remove(self._cdp_runner)
            await self._cdp_runner.cleanup()
            self._cdp_runner = None

    async def _serve(self, app: web.Application, tls: ssl.SSLContext | None) -> web.AppRunner:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls).start()
        self._runners.append(runner)
        return runner

    # ----- what clients need

    @property
    def pki_connection(self) -> str:
        """``host:port`` (HTTPS, EST's default), or ``http://host:port`` for a server without TLS."""
        return f"127.0.0.1:{self.port}" if self.tls else f"http://127.0.0.1:{self.port}"

    @property
    def origin(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Where the EST operations are, without a slash at the end: ``url + "/cacerts"``."""
        label = f"/{self.path_segment}" if self.path_segment else ""
        return f"{self.origin}/.well-known/est{label}"

    @property
    def mirror_origin(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.mirror_port}"

    @property
    def mirror_url(self) -> str:
        return self.mirror_origin + self.url.removeprefix(self.origin)

    def crl_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.cdp_port}/{name}.crl"

    @property
    def tls_ca_pem(self) -> str:
        return _pem([self.tls_ca.certificate])

    @property
    def ca_certificate(self) -> x509.Certificate:
        """The EST root CA."""
        return self.root.certificate

    @property
    def ca_certificates(self) -> list[x509.Certificate]:
        """The EST CA chain, issuing CA first."""
        return [self.issuing.certificate, self.root.certificate] if self.intermediate else [self.root.certificate]

    @property
    def client_certificate(self) -> x509.Certificate:
        return self._client_certificate

    @property
    def client_pkcs12_base64(self) -> str:
        """A TLS client credential the server accepts (issued by the EST CA), encrypted with
        ``client_pkcs12_password``."""
        blob = pkcs12.serialize_key_and_certificates(
            b"est-ra",
            self._client_key,
            self._client_certificate,
            None,
            serialization.BestAvailableEncryption(self.client_pkcs12_password.encode()),
        )
        return base64.b64encode(blob).decode()

    def tls_crl(self) -> x509.CertificateRevocationList:
        """The TLS CA's CRL: it revokes the server's TLS certificate while ``tls_certificate_revoked``, the mirror's
        while ``mirror_tls_certificate_revoked``."""
        return self._crl(self.tls_ca, self._tls_revocations())

    # ----- PKI

    def announce_new_root(self, common_name: str = "EST Test Root CA", *, broken_link: bool = False) -> RootKeyUpdate:
        """Give the root CA a new key and announce it in ``/cacerts`` with the root CA key update certificates; the
        server goes on issuing from the old root until ``issue_from_new_root``. The new root keeps the old name
        unless ``common_name`` says otherwise (RFC 4210 §4.4 keeps it; a new name is as valid). ``broken_link``
        signs NewWithOld with a stranger's key under the old root's name, as a forger would have to. A server started
        with an intermediate gets a new issuing CA under the new root too ("EST Test Issuing CA G2"), announced with
        the rollover certificates; its CRL is at ``crl_url("issuing2")``."""
        old = self.root
        key = ec_key()
        new = _Authority(
            # A successor outlives the root it follows.
            _certificate(_name(common_name), key, None, is_ca=True, cdp=self.crl_url("root2"), days=60),
            key,
            "root2",
        )
        signer = old
        if broken_link:
            stranger_key = ec_key()
            stranger = _certificate(old.certificate.subject, stranger_key, None, is_ca=True)
            signer = _Authority(stranger, stranger_key, "stranger")
        new_issuing = None
        if self.intermediate:
            issuing_key = ec_key()
            new_issuing = _Authority(
                _certificate(_name("EST Test Issuing CA G2"), issuing_key, new, is_ca=True, cdp=self.crl_url("root2"),
                             days=50),
                issuing_key,
                "issuing2",
            )  # fmt: skip
            self._authorities["issuing2"] = new_issuing
        self._authorities["root2"] = new
        self.rollover = RootKeyUpdate(
            old=old,
            new=new,
            new_with_old=_certificate(new.certificate.subject, key, signer, is_ca=True, cdp=self.crl_url("root")),
            old_with_new=_certificate(old.certificate.subject, old.key, new, is_ca=True, cdp=self.crl_url("root2")),  # type: ignore[arg-type]
            new_issuing=new_issuing,
        )
        return self.rollover

    def issue_from_new_root(self) -> None:
        """Issue from the announced root (or the issuing CA under it) from now on (``ca_certificates`` is then its
        chain); ``/cacerts`` still serves the key update certificates, as RFC 7030 §4.1.3 asks while peers may hold
        the old root."""
        assert self.rollover is not None, "announce_new_root first"
        self.root = self.rollover.new
        self.issuing = self.rollover.new_issuing or self.rollover.new

    def announce_new_issuing_ca(self, common_name: str = "EST Test Issuing CA 2") -> _Authority:
        """A new issuing CA under the current root, which outlives the current issuing CA, served in ``/cacerts``
        beside the current chain; the server goes on issuing from the current one until
        ``issue_from_new_issuing_ca``. Its CRL is at ``crl_url("issuing-next")``."""
        key = ec_key()
        self.new_issuing_ca = _Authority(
            _certificate(_name(common_name), key, self.root, is_ca=True, cdp=self.crl_url("root"), days=50),
            key,
            "issuing-next",
        )
        self._authorities["issuing-next"] = self.new_issuing_ca
        return self.new_issuing_ca

    def issue_from_new_issuing_ca(self) -> None:
        """Issue from the announced issuing CA from now on; ``/cacerts`` keeps serving the previous one."""
        assert self.new_issuing_ca is not None, "announce_new_issuing_ca first"
        self.previous_issuing_ca, self.issuing = self.issuing, self.new_issuing_ca
        self.intermediate = True

    def _make_pki(self) -> None:
        root_key = ec_key()
        # The root names its own CRL: /pki/crl finds it from the CA certificate /cacerts delivers.
        root = _certificate(_name("EST Test Root CA"), root_key, None, is_ca=True, cdp=self.crl_url("root"))
        self.root = _Authority(root, root_key, "root")
        self.issuing = self.root
        if self.intermediate:
            key = ec_key()
            certificate = _certificate(
                _name("EST Test Issuing CA"), key, self.root, is_ca=True, cdp=self.crl_url("root")
            )
            self.issuing = _Authority(certificate, key, "issuing")
        self._authorities = {"root": self.root, "issuing": self.issuing}
        tls_ca_key = ec_key()
        self.tls_ca = _Authority(
            _certificate(_name("EST Test TLS CA"), tls_ca_key, None, is_ca=True), tls_ca_key, "tls"
        )
        self._tls_key = ec_key()
        tls_issuer = self.issuing if self.tls_issued_by_est_ca else self.tls_ca
        self.tls_certificate = _certificate(
            _name("est.test"), self._tls_key, tls_issuer, is_ca=False, hosts=("127.0.0.1", "localhost"),
            cdp=self.crl_url("tls"),
        )  # fmt: skip
        self._mirror_key = ec_key()
        mirror_ca = self.tls_ca
        if not self.mirror_tls_trusted:
            untrusted_key = ec_key()
            untrusted = _certificate(_name("EST Test Untrusted TLS CA"), untrusted_key, None, is_ca=True)
            mirror_ca = _Authority(untrusted, untrusted_key, "untrusted")
        self._mirror_issuer = mirror_ca.certificate
        self.mirror_tls_certificate = _certificate(
            _name("est-mirror.test"), self._mirror_key, mirror_ca, is_ca=False, hosts=("127.0.0.1", "localhost"),
            cdp=self.crl_url("tls"),
        )  # fmt: skip
        self._client_key = ec_key()
        client_csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(_name("certlm EST RA"))
            .add_extension(
                x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:certlm:test:est-ra")]), critical=False
            )
            .sign(self._client_key, hashes.SHA256())
        )
        self._client_certificate = self._issue(client_csr)
        self.issued.clear()

    def _issue(self, csr: x509.CertificateSigningRequest) -> x509.Certificate:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value if csr.extensions else None
        is_server = bool(san and (san.get_values_for_type(x509.DNSName) or san.get_values_for_type(x509.IPAddress)))
        policy = ca.IssuancePolicy(validity=timedelta(days=10), crl_url=self.crl_url(self.issuing.crl_name))
        certificate = ca.issue(
            csr,
            SERVER_PROFILE if is_server else CLIENT_PROFILE,
            self.issuing.certificate,
            self.issuing.key,  # type: ignore[arg-type]
            policy,
            datetime.now(UTC),
        )
        if self.uri_san_only:
            certificate = self._without_host_names(certificate)
        self.issued.append(certificate)
        return certificate

    def _without_host_names(self, certificate: x509.Certificate) -> x509.Certificate:
        """``certificate`` signed again with only the URIs of its subject alternative names."""
        builder = (
            x509.CertificateBuilder()
            .subject_name(certificate.subject)
            .issuer_name(certificate.issuer)
            .public_key(certificate.public_key())
            .serial_number(certificate.serial_number)
            .not_valid_before(certificate.not_valid_before_utc)
            .not_valid_after(certificate.not_valid_after_utc)
        )
        for extension in certificate.extensions:
            value = extension.value
            if isinstance(value, x509.SubjectAlternativeName):
                uris = value.get_values_for_type(x509.UniformResourceIdentifier)
                value = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri) for uri in uris])
            builder = builder.add_extension(value, extension.critical)
        return builder.sign(self.issuing.key, hashes.SHA256())  # type: ignore[arg-type]

    def _crl(self, authority: _Authority, revocations: list[ca.Revocation]) -> x509.CertificateRevocationList:
        """The authority's CRL as a CA publishes it: the same one until what it revokes changes. (A CA re-signs its
        CRL at its next update, not for each download; a new CRL per request would give every device its own.)"""
        key = (
            authority.certificate.fingerprint(hashes.SHA256()),
            tuple(sorted(revocation.serial_number for revocation in revocations)),
        )
        if key not in self._crls:
            number = len(self._crls) + 1
            self._crls[key] = ca.build_crl(authority.certificate, authority.key, revocations, number, datetime.now(UTC))  # type: ignore[arg-type]
        return self._crls[key]

    def _tls_revocations(self) -> list[ca.Revocation]:
        revoked = []
        if self.tls_certificate_revoked:
            revoked.append(self.tls_certificate)
        if self.mirror_tls_certificate_revoked:
            revoked.append(self.mirror_tls_certificate)
        return [
            ca.Revocation(certificate.serial_number, datetime.now(UTC), x509.ReasonFlags.key_compromise)
            for certificate in revoked
        ]

    def _server_tls(self, name: str, chain: list[x509.Certificate], key: ec.EllipticCurvePrivateKey) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        certificate_file = self.directory / f"{name}-tls-{id(self)}.pem"
        key_file = self.directory / f"{name}-tls-{id(self)}.key"
        certificate_file.write_text(_pem(chain))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        key_file.chmod(0o600)
        context.load_cert_chain(certificate_file, key_file)
        # Client certificates are optional at the TLS layer; each operation's policy decides what it needs.
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=_pem(self.ca_certificates))
        return context

    # ----- HTTP

    def _cdp_app(self) -> web.Application:
        async def crl(request: web.Request) -> web.Response:
            # The EST CAs revoke nothing; the TLS CA revokes the server's certificate when a test says so.
            authority = {**self._authorities, "tls": self.tls_ca}.get(request.match_info["name"])
            if authority is None:
                raise web.HTTPNotFound()
            built = self._crl(authority, self._tls_revocations() if authority is self.tls_ca else [])
            return web.Response(
                body=built.public_bytes(serialization.Encoding.DER), content_type="application/pkix-crl"
            )

        app = web.Application()
        app.router.add_get("/{name}.crl", crl)
        return app

    def _est_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024, middlewares=[self._scripted_redirect])
        for path in ("/.well-known/est/{operation}", "/.well-known/est/{label}/{operation}"):
            if self.trailing_slash:
                app.router.add_route("*", path + "/", self._handle)
                app.router.add_route("*", path, self._add_slash)
            else:
                app.router.add_route("*", path, self._handle)
        return app

    def _request_url(self, request: web.Request) -> str:
        """The URL a request reached, its origin named by the listener's port (the Host header could say anything)."""
        port = request.transport.get_extra_info("sockname")[1] if request.transport else 0
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{port}{request.path}"

    def _record(self, request: web.Request, operation: str | None) -> SeenRequest:
        seen = SeenRequest(
            operation,
            self._basic_user(request),
            self._peer_certificate(request),
            request.headers.get("Content-Type"),
            self._request_url(request),
            "Authorization" in request.headers,
            request.method,
        )
        self.requests.append(seen)
        return seen

    @web.middleware
    async def _scripted_redirect(self, request: web.Request, handler) -> web.StreamResponse:
        url = self._request_url(request)
        location = self.redirects.get(f"{url}?{request.query_string}" if request.query_string else url)
        if location is None:
            return await handler(request)
        self._record(request, request.match_info.get("operation"))
        return web.Response(status=self.redirect_status, headers={"Location": location}, text="moved")

    async def _add_slash(self, request: web.Request) -> web.Response:
        self._record(request, request.match_info["operation"])
        location = request.path + "/" + (f"?{request.query_string}" if request.query_string else "")
        return web.Response(status=self.slash_redirect_status, headers={"Location": location}, text="moved")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        operation = request.match_info["operation"]
        if request.match_info.get("label") != self.path_segment:
            raise web.HTTPNotFound(text="no such EST label")
        handlers = {
            "cacerts": ("GET", self._cacerts),
            "csrattrs": ("GET", self._csrattrs),
            "simpleenroll": ("POST", self._simpleenroll),
            "simplereenroll": ("POST", self._simplereenroll),
            "serverkeygen": ("POST", self._serverkeygen),
        }
        if operation not in handlers:
            raise web.HTTPNotFound(text=f"no EST operation {operation}")
        method, handler = handlers[operation]
        if request.method != method:
            raise web.HTTPMethodNotAllowed(request.method, [method])
        seen = self._record(request, operation)
        peer = seen.client_certificate
        policy = self.auth.get(operation, "none")
        basic_ok, certificate_ok = seen.basic_user == self.username, peer is not None
        allowed = {
            "none": True,
            "basic": basic_ok,
            "certificate": certificate_ok,
            "either": basic_ok or certificate_ok,
            "both": basic_ok and certificate_ok,
        }[policy]
        if not allowed:
            return web.Response(
                status=401, text="authentication required", headers={"WWW-Authenticate": 'Basic realm="estrealm"'}
            )
        return await handler(request, peer)

    def _basic_user(self, request: web.Request) -> str | None:
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return user if hmac.compare_digest(password.encode(), self.password.encode()) else f"(wrong password) {user}"

    @staticmethod
    def _peer_certificate(request: web.Request) -> x509.Certificate | None:
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
        return x509.load_der_x509_certificate(der) if der else None

    def _base64(self, der: bytes) -> bytes:
        return base64.b64encode(der) if self.single_line_base64 else base64.encodebytes(der).replace(b"\n", b"\r\n")

    def _certs_only(self, certificates: list[x509.Certificate]) -> web.Response:
        der = pkcs7.serialize_certificates(certificates, serialization.Encoding.DER)
        return web.Response(
            body=self._base64(der), headers={"Content-Type": CERTS_ONLY, "Content-Transfer-Encoding": "base64"}
        )

    async def _cacerts(self, request: web.Request, peer: x509.Certificate | None) -> web.Response:
        certificates = self.ca_certificates
        for announced in (self.new_issuing_ca, self.previous_issuing_ca):
            if announced is not None and announced.certificate not in certificates:
                certificates = [announced.certificate, *certificates]
        if self.rollover is not None:
            certificates = list(
                {c.fingerprint(hashes.SHA256()): c for c in certificates + self.rollover.certificates}.values()
            )
        return self._certs_only(certificates[::-1] if self.shuffle else certificates)

    async def _csrattrs(self, request: web.Request, peer: x509.Certificate | None) -> web.Response:
        if self.csr_attributes is None:
            return web.Response(status=204)
        return web.Response(
            body=self._base64(self.csr_attributes),
            headers={"Content-Type": "application/csrattrs", "Content-Transfer-Encoding": "base64"},
        )

    async def _read_csr(self, request: web.Request) -> x509.CertificateSigningRequest:
        if request.content_type != "application/pkcs10":
            raise web.HTTPUnsupportedMediaType(text=f"expected application/pkcs10, got {request.content_type}")
        try:
            csr = x509.load_der_x509_csr(base64.b64decode(b"".join((await request.read()).split()), validate=True))
        except (binascii.Error, ValueError):
            raise web.HTTPBadRequest(text="body is not a base64 DER PKCS#10 request") from None
        if not csr.is_signature_valid:
            raise web.HTTPBadRequest(text="CSR signature does not verify")
        if self.enforce_csr_attributes and self.csr_attributes is not None:
            asked = {str(oid) for oid in self._asked_signature_algorithms()}
            if asked and csr.signature_algorithm_oid.dotted_string not in asked:
                raise web.HTTPBadRequest(text=f"CSR signature algorithm must be one of {sorted(asked)}")
        return csr

    def _asked_signature_algorithms(self) -> list[str]:
        items, _ = decoder.decode(self.csr_attributes, asn1Spec=rfc7030.CsrAttrs())
        oids = [str(item["oid"]) for item in items if item.getName() == "oid"]
        return [oid for oid in oids if oid in SIGNATURE_ALGORITHMS]

    async def _before_enrolling(self) -> web.Response | None:
        """The pending and failure behaviour every enrollment operation shares."""
        if self.pending > 0:
            self.pending -= 1
            return web.Response(status=202, headers={"Retry-After": self.retry_after}, text="pending approval")
        if self.failure == "slow":
            await asyncio.sleep(self.slow_seconds)
        if self.failure == "500":
            return web.Response(status=500, text="internal EST failure")
        return None

    def _enrolled(self, certificate: x509.Certificate) -> web.Response:
        chain = self.ca_certificates if self.enroll_includes_chain else []
        certificates = [certificate, *chain]
        if self.shuffle:  # the issued certificate neither first nor last where the chain allows it
            certificates = [*chain[::-1][:1], certificate, *chain[::-1][1:]]
        if self.failure == "foreign-certificate":
            certificates = [self.tls_certificate, *chain]
        der = pkcs7.serialize_certificates(certificates, serialization.Encoding.DER)
        if self.failure == "truncated":
            return web.Response(
                body=self._base64(der[: len(der) // 2]),
                headers={"Content-Type": CERTS_ONLY, "Content-Transfer-Encoding": "base64"},
            )
        if self.failure == "content-type":
            return web.Response(body=self._base64(der), content_type="text/html")
        if self.failure == "garbage":
            return web.Response(body=b"<html>definitely not base64!</html>", headers={"Content-Type": CERTS_ONLY})
        return self._certs_only(certificates)

    async def _enroll(self, csr: x509.CertificateSigningRequest) -> web.Response:
        """The answer to an enrollment for ``csr``, after any scripted delay or refusal; 400 with the CA's reason
        where it does not issue."""
        if (early := await self._before_enrolling()) is not None:
            return early
        try:
            return self._enrolled(self._issue(csr))
        except APIError as error:
            return web.Response(status=400, text=error.message)

    async def _simpleenroll(self, request: web.Request, peer: x509.Certificate | None) -> web.Response:
        return await self._enroll(await self._read_csr(request))

    async def _simplereenroll(self, request: web.Request, peer: x509.Certificate | None) -> web.Response:
        csr = await self._read_csr(request)
        # RFC 7030 §4.2.2: a re-enrollment keeps the subject of the certificate it renews, which is the TLS
        # client certificate or (an RA renewing for a device) a certificate this server issued.
        known = {certificate.subject for certificate in self.issued} | ({peer.subject} if peer else set())
        if csr.subject not in known:
            return web.Response(status=400, text=f"no certificate with subject {csr.subject.rfc4514_string()} to renew")
        return await self._enroll(csr)

    async def _serverkeygen(self, request: web.Request, peer: x509.Certificate | None) -> web.Response:
        csr = await self._read_csr(request)
        if not self.serverkeygen:
            return web.Response(status=self.serverkeygen_refusal, text="server-side key generation is not offered")
        if (early := await self._before_enrolling()) is not None:
            return early
        placeholder = csr.public_key()
        if isinstance(placeholder, rsa.RSAPublicKey):
            key = rsa.generate_private_key(65537, placeholder.key_size)
        else:
            key = ec_key()
        builder = x509.CertificateSigningRequestBuilder().subject_name(csr.subject)
        for extension in csr.extensions:
            builder = builder.add_extension(extension.value, extension.critical)
        try:
            certificate = self._issue(builder.sign(key, hashes.SHA256()))
        except APIError as error:
            return web.Response(status=400, text=error.message)
        key_der = key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        certificates_der = pkcs7.serialize_certificates(
            [certificate, *(self.ca_certificates if self.enroll_includes_chain else [])], serialization.Encoding.DER
        )
        boundary = f"est-{secrets.token_hex(8)}"
        parts = [
            (
                f"--{boundary}\r\nContent-Type: application/pkcs8\r\nContent-Transfer-Encoding: base64\r\n\r\n".encode()
                + self._base64(key_der)
            ),
            (
                f"\r\n--{boundary}\r\nContent-Type: {CERTS_ONLY}\r\nContent-Transfer-Encoding: base64\r\n\r\n".encode()
                + self._base64(certificates_der)
            ),
            f"\r\n--{boundary}--\r\n".encode(),
        ]
        return web.Response(body=b"".join(parts), headers={"Content-Type": f"multipart/mixed; boundary={boundary}"})
