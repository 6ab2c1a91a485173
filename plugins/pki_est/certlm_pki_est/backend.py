"""PKI type 2, ``est``: certificates from a plant's EST server (RFC 7030), reached at the entry's ``pki_connection``
(HTTPS unless it says ``http://``) with its ``additional_path_segment``, HTTP basic and/or TLS client
authentication, and at the origins in its ``redirect_origins`` where the server redirects there, without them.

A new root CA the server announces in ``/cacerts`` (RFC 7030 §4.1.3), or a new issuing CA under the root the entry
holds, is the successor a ``ca-rollover`` campaign moves the devices to (``successor_issuer``, verified in
``rollover``); the entry takes it as its chain with the first certificate the server issues from it."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import re
import ssl
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from certlm import (
    APIError,
    CsrRejected,
    Enrollment,
    EnrollmentRequest,
    KeyedEnrollment,
    NotFound,
    PkiBackend,
    PkiEntry,
    ServerValidation,
    SuccessorIssuer,
    UpstreamUnavailable,
    api_timestamp,
    crl_signed_by,
    is_self_signed,
    issued_by,
    issuer_chain,
    load_crl,
    pki_client,
    serial_hex,
    sha1_fingerprint,
    spki_der,
)
from certlm_pki_est import csrattrs, rollover
from certlm_pki_est.client import EstClient, EstEndpoint, OtherOrigins

log = logging.getLogger(__name__)

# RFC 7030 §3.2.2: the additional path segment is one URI path segment (RFC 3986 segment-nz).
_LABEL = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})+")


class EstPki(PkiBackend):
    """An EST client. The EST server's policy, chosen by the entry's path segment, decides the certificate
    profile: EST requests carry no profile, so ``CertificateProfile`` is not sent and the CSR must name
    everything the certificate should (the host names included)."""

    pki_type = 2
    name = "est"

    def configuration_problems(self, entry: PkiEntry) -> list[str]:
        """What is malformed; what is merely missing (credentials) is reported when the entry is used."""
        problems = []
        if pki_client.network_connection(entry.pki_connection) is None:
            problems.append(
                "an EST entry (pki_type 2) needs pki_connection host:port of its EST server (or https://host:port, "
                "http://host:port), port 1 to 65535"
            )
        segment = entry.additional_path_segment
        if segment and (not _LABEL.fullmatch(segment.removeprefix("/")) or segment.strip("/") in (".", "..")):
            problems.append(
                f"additional_path_segment {segment!r} is not an EST label (RFC 7030 §3.2.2): one URI path segment "
                "such as 'opcua-devices' or '/opcua-devices'"
            )
        if entry.username and ":" in entry.username:
            problems.append("username must not contain ':' (HTTP basic authentication, RFC 7617)")
        return problems

    async def validate(self, entry: PkiEntry, *, strict: bool) -> ServerValidation:
        """RFC 7030 §4.1.1 bootstrap: fetch ``/cacerts`` and store the CA certificates, issuing CA first. No
        credentials are sent. Without ``tls_ca`` the server is not authenticated, which is why the endpoint
        reports the fingerprints for the operator to compare out of band; with it (and always when strict) the
        server's certificate must verify against it, and strict also checks it against the entry's TLS CRLs. A
        redirect to an origin in ``redirect_origins`` is followed with the same TLS verification; strict checks
        that server as it checks ``pki_connection``'s before the first request to it."""
        endpoint = self._endpoint(entry)
        anchors = pki_client.tls_trust_anchors(entry)
        if strict and not endpoint.server.uses_tls:
            raise APIError(
                f"validate-strict verifies the TLS chain of the EST server, but pki_connection "
                f"{entry.pki_connection!r} of PKI entry {entry.id} chooses plain HTTP: write https://"
            )
        if strict and not anchors:
            raise APIError(
                f"validate-strict requires tls_ca: PKI entry {entry.id} has no TLS CA certificate to verify "
                f"EST server {endpoint.where} against"
            )
        if anchors:
            tls, trust = pki_client.ssl_context(entry), "the entry's tls_ca"
        else:
            tls, trust = _unverified_tls(), "nothing (not verified)"
        vet = functools.partial(self._vet_strictly, entry, tls, anchors) if strict else None
        if vet is not None:
            await vet(endpoint.server)
        # No credentials go anywhere here, so the other origins get the same context.
        other_origins = OtherOrigins(pki_client.allowed_redirect_origins(entry), tls=lambda: tls, vet=vet)
        try:
            async with self._client(endpoint, tls, trust, other_origins) as client:
                certificates = await client.ca_certificates()
        except pki_client.ServerNotTrusted as error:
            raise APIError(error.message) from None
        ordered = ca_chain_order(certificates, pki_client.stored_ca_certificates(entry))
        await pki_client.store_ca_certificates(entry, ordered)
        log.info(
            "PKI entry %s: stored %d CA certificate(s) from EST server %s (%s)",
            entry.id,
            len(ordered),
            endpoint.where,
            ", ".join(sha1_fingerprint(certificate) for certificate in ordered),
        )
        return ServerValidation(endpoint.server.host, endpoint.server.port, tuple(ordered))

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        certificates = pki_client.stored_ca_certificates(entry)
        if not certificates:
            raise NotFound(f"No CA available for PKI entry {entry.id}: run GET /pki/exec/validate/{entry.id} first")
        return certificates

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        """Fetched live from the CRL distribution points of the stored CA certificates (issuing CA first), then
        from ``est_cdp_urls``, whether or not validate has run. Once validate has stored the CA certificates the
        CRL must be signed by one of them; before, it is served as delivered (it carries its own signature)."""
        stored = pki_client.stored_ca_certificates(entry)
        urls = pki_client.crl_urls(entry, stored)
        if not urls:
            advice = (
                "its CA certificates name none; set est_cdp_urls"
                if stored
                else f"set est_cdp_urls, or run GET /pki/exec/validate/{entry.id} to learn the CA certificate's"
            )
            raise NotFound(f"No CRL distribution point available for PKI entry {entry.id}: {advice}")
        return await pki_client.fetch_crl(urls, stored, self.services)

    async def issue(self, entry: PkiEntry, request: EnrollmentRequest) -> Enrollment:
        """``simpleenroll``, or ``simplereenroll`` when renewing a certificate with the CSR's subject (RFC 7030
        §4.2.2 lets a re-enrollment change only the key; a new subject is a new enrollment). The server's
        ``csrattrs`` are fetched first: when certlm made the key it re-signs the CSR as they ask."""
        endpoint = self._endpoint(entry)
        csr = request.csr
        async with self._enrollment_client(entry, endpoint) as client:
            attributes = await client.csr_attributes()
            if attributes and request.private_key is not None:
                csr = csrattrs.follow(attributes, csr, request.private_key)
            renew = request.renewing is not None and request.renewing.subject == csr.subject
            try:
                certificates = await client.enroll(csr, renew=renew)
            except CsrRejected as error:
                lacking = csrattrs.unmet(attributes, csr)
                if not lacking:
                    raise
                raise CsrRejected(
                    f"{error.message}; the server's csrattrs ask for what the CSR lacks: {'; '.join(lacking)}"
                ) from None
        enrollment = self._enrollment(entry, endpoint, csr.public_key(), certificates, "the CSR's public key")
        return await self._adopt_successor(entry, enrollment)

    async def issue_with_server_key(self, entry: PkiEntry, request: EnrollmentRequest) -> KeyedEnrollment:
        """``serverkeygen`` (RFC 7030 §4.4); EST has no re-enrollment form of it. The key comes back as an
        unencrypted PKCS#8 protected by the TLS session, the only form certlm asks for."""
        endpoint = self._endpoint(entry)
        async with self._enrollment_client(entry, endpoint) as client:
            key, certificates = await client.server_keygen(request.csr)
        enrollment = await self._adopt_successor(
            entry, self._enrollment(entry, endpoint, key.public_key(), certificates, "the key it generated")
        )
        return KeyedEnrollment(enrollment.certificate, enrollment.chain, private_key=key)

    async def successor_issuer(self, entry: PkiEntry) -> SuccessorIssuer:
        """The new root CA the EST server announces in ``/cacerts`` (RFC 7030 §4.1.3, the root CA key update
        certificates of §4.4), or else a new issuing CA it serves under the root the entry holds, verified against
        that root (``rollover``), with its chain and, where its distribution points deliver one, its CRL. The entry
        stays as it is: the campaign's old issuer is the chain it holds, and the first enrollment the server answers
        from the new CA makes the new chain the entry's (``_adopt_successor``). 409 when nothing new is announced or
        certlm holds no CA yet; 502 when the server cannot be reached or announces a CA that does not verify."""
        announcement = await self._announcement(entry)
        crls: tuple[x509.CertificateRevocationList, ...] = ()
        urls = [url for certificate in announcement.chain for url in pki_client.cdp_urls(certificate)]
        try:
            crls = (await pki_client.fetch_crl(list(dict.fromkeys(urls)), list(announcement.chain), self.services),)
        except APIError as error:
            # A CA that has issued nothing yet may publish no CRL; the reissue phase fetches the CRLs of each chain.
            log.info("PKI entry %s: no CRL of the announced CA yet: %s", entry.id, error.message)
        where, held_root = self._endpoint(entry).where, rollover.describe(announcement.held_root)
        if announcement.new_with_new is not None:
            how = (
                f"EST server {where} announced the new root CA {rollover.describe(announcement.new_with_new)} in "
                f"/cacerts, linked to the root CA certlm holds, {held_root}, by a NewWithOld certificate its key "
                f"signed (RFC 7030 §4.4); PKI entry {entry.id} issues from it once the EST server does"
            )
        else:
            how = (
                f"EST server {where} announced the new issuing CA {rollover.describe(announcement.chain[0])} in "
                f"/cacerts, issued under the root CA certlm holds, {held_root}, which both chains share and the "
                f"campaign keeps; PKI entry {entry.id} issues from it once the EST server does"
            )
        log.info("PKI entry %s: %s", entry.id, how)
        return SuccessorIssuer(pki_id=entry.id, chain=announcement.chain, crls=crls, how=how)

    async def _announcement(self, entry: PkiEntry) -> rollover.Announcement:
        held = pki_client.stored_ca_certificates(entry)
        if not held:
            raise APIError(
                f"PKI entry {entry.id} (EST) holds no CA certificates to verify an announced CA against: run GET "
                f"/pki/exec/validate/{entry.id} first",
                409,
            )
        endpoint = self._endpoint(entry)
        tls, trust = enrollment_tls(entry, None)
        # /cacerts needs no credentials (RFC 7030 §4.1.1), and none are sent, here or to another origin.
        other_origins = OtherOrigins(
            pki_client.allowed_redirect_origins(entry), tls=lambda: enrollment_tls(entry, None)[0]
        )
        async with self._client(endpoint, tls, trust, other_origins) as client:
            bag = await client.ca_certificates()
        try:
            return rollover.announced_successor(held, bag, datetime.now(UTC), endpoint.where)
        except rollover.NothingAnnounced as nothing:
            raise APIError(str(nothing), 409) from None
        except rollover.AnnouncementRefused as refused:
            raise UpstreamUnavailable(str(refused)) from None

    async def _adopt_successor(self, entry: PkiEntry, enrollment: Enrollment) -> Enrollment:
        """Make the announced CA's chain the entry's once the server issues from it. Without this every later push
        would put the old CA back into the device's trust list (a push trusts the entry's chain) after a campaign
        retired it. Only a chain the server also announces, verified as ``successor_issuer`` verifies it, is taken:
        an enrollment's answer alone does not make a new trust anchor. A certificate a CA certlm holds issued, or one
        the announced CA did not issue, leaves the entry as it is. Returns the enrollment, with the announced chain
        when the server sent none."""
        held = pki_client.stored_ca_certificates(entry)
        # Issued by a CA certlm holds: nothing new. Its path may pass through a held root (a new issuing CA under the
        # same root), which the announcement then vouches for as it does for a new root.
        if not held or any(issued_by(enrollment.certificate, ca) for ca in held):
            return enrollment
        try:
            announcement = await self._announcement(entry)
        except APIError as error:
            log.warning(
                "PKI entry %s: the EST server issued %s from a CA certlm does not hold (%s), and its announcement "
                "does not vouch for that CA: %s", entry.id, serial_hex(enrollment.certificate),
                enrollment.certificate.issuer.rfc4514_string(), error.message,
            )  # fmt: skip
            return enrollment
        if not issued_by(enrollment.certificate, announcement.chain[0]):
            return enrollment
        await pki_client.store_ca_certificates(entry, announcement.chain)
        log.info(
            "PKI entry %s: the EST server issues from the new CA %s it announced; it is now the entry's CA chain",
            entry.id, rollover.describe(announcement.chain[0]),
        )  # fmt: skip
        return enrollment if enrollment.chain else dataclasses.replace(enrollment, chain=announcement.chain)

    def _endpoint(self, entry: PkiEntry) -> EstEndpoint:
        return EstEndpoint(pki_client.pki_server(entry, "EST", "https"), entry.additional_path_segment)

    def _client(
        self, endpoint: EstEndpoint, tls: ssl.SSLContext, trust: str, other_origins: OtherOrigins, **credentials
    ) -> EstClient:
        settings = self.services.settings
        return EstClient(
            endpoint,
            tls=tls,
            trust=trust,
            timeout=pki_client.request_timeout(self.services),
            pending_wait_s=settings.pki_pending_wait_s,
            other_origins=other_origins,
            **credentials,
        )

    def _enrollment_client(self, entry: PkiEntry, endpoint: EstEndpoint) -> EstClient:
        require_credentials(entry, endpoint)
        credential = pki_client.client_credential(entry, self.services)
        password = pki_client.password(entry, self.services)
        named = []
        basic_auth = None
        if entry.username and password:
            basic_auth = (entry.username, password)
            named.append(f"HTTP basic authentication as {entry.username!r}")
        if credential is not None:
            named.append(f"TLS client certificate {credential.certificate.subject.rfc4514_string()!r}")
        tls, trust = enrollment_tls(entry, credential)
        # The same trust at another origin, but never the client certificate (RFC 7030 §3.2.1: a new TLS
        # connection there); made only when a redirect goes there.
        other_origins = OtherOrigins(
            pki_client.allowed_redirect_origins(entry), tls=lambda: enrollment_tls(entry, None)[0]
        )
        return self._client(
            endpoint,
            tls,
            trust,
            other_origins,
            basic_auth=basic_auth,
            credentials=" and ".join(named) or "no credentials",
        )

    async def _vet_strictly(
        self, entry: PkiEntry, tls: ssl.SSLContext, anchors: list[x509.Certificate], server: pki_client.PkiServer
    ) -> None:
        """validate-strict's checks of a server before anything is sent to it: TLS, a certificate that verifies
        against ``tls_ca``, not revoked by the TLS CA's CRLs. 400 otherwise."""
        if not server.uses_tls:
            raise APIError(
                f"validate-strict verifies the TLS chain of the EST server, but it redirects to {server.origin}, "
                "which is plain HTTP: not followed"
            )
        certificate = await self._tls_server_certificate(server, tls)
        await self._check_not_revoked(entry, server, certificate, anchors)

    async def _tls_server_certificate(self, server: pki_client.PkiServer, tls: ssl.SSLContext) -> x509.Certificate:
        """The certificate the server presents in a handshake verified by ``tls``; 400 when it does not verify."""
        timeout = pki_client.request_timeout(self.services)
        peer = f"EST server {server.where}"
        try:
            with pki_client.reported_transport_failures(
                peer, server, "the TLS handshake", timeout, "the entry's tls_ca"
            ):
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(server.host, server.port, ssl=tls, server_hostname=server.host),
                    timeout.total,
                )
        except pki_client.ServerNotTrusted as error:
            raise APIError(error.message) from None
        try:
            der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        finally:
            writer.close()
        return x509.load_der_x509_certificate(der)

    async def _check_not_revoked(
        self,
        entry: PkiEntry,
        server: pki_client.PkiServer,
        certificate: x509.Certificate,
        anchors: list[x509.Certificate],
    ) -> None:
        """400 when a CRL of the TLS CA (stored in ``tls_crls`` or fetched from ``tls_cdp_urls``) revokes the
        server's certificate. Only CRLs signed by a ``tls_ca`` certificate count."""
        crls = [crl for crl in (load_crl(pem) for pem in entry.tls_crls or ()) if crl_signed_by(crl, anchors)]
        if entry.tls_cdp_urls:
            crls.append(await pki_client.fetch_crl(list(entry.tls_cdp_urls), anchors, self.services))
        for crl in crls:
            if crl.issuer != certificate.issuer:
                continue
            revoked = crl.get_revoked_certificate_by_serial_number(certificate.serial_number)
            if revoked is not None:
                raise APIError(
                    f"TLS certificate of EST server {server.where} (serial {serial_hex(certificate)}) is "
                    f"revoked since {api_timestamp(revoked.revocation_date_utc)} by the CRL of "
                    f"{crl.issuer.rfc4514_string()}"
                )

    def _enrollment(
        self,
        entry: PkiEntry,
        endpoint: EstEndpoint,
        public_key: PublicKeyTypes,
        certificates: list[x509.Certificate],
        key_name: str,
    ) -> Enrollment:
        """The certificate for ``public_key`` among those answered, with its issuer chain built from the others
        and the stored CA certificates."""
        wanted = spki_der(public_key)
        issued = next((c for c in certificates if spki_der(c.public_key()) == wanted), None)
        if issued is None:
            raise UpstreamUnavailable(
                f"EST server {endpoint.where} answered {len(certificates)} certificate(s), none of them for "
                f"{key_name}: the answer is not used"
            )
        pool = [c for c in certificates if c is not issued] + pki_client.stored_ca_certificates(entry)
        return Enrollment(certificate=issued, chain=tuple(issuer_chain(issued, pool)))


def require_credentials(entry: PkiEntry, endpoint: EstEndpoint) -> None:
    """400 naming the field when the entry cannot authenticate an enrollment: HTTP basic needs username and
    password, a TLS client certificate needs TLS. Checked at use, so that an entry can be stored half-configured."""
    prefix = f"PKI entry {entry.id} (EST)"
    has_certificate = bool(entry.est_client_pkcs12_enc)
    if entry.username and not entry.password_enc:
        alternative = (
            " or remove username to authenticate with the TLS client certificate alone" if has_certificate else ""
        )
        raise APIError(
            f"{prefix} has username {entry.username!r} but no password: set password (HTTP basic "
            f"authentication){alternative}"
        )
    if entry.password_enc and not entry.username:
        raise APIError(f"{prefix} has a password but no username: set username (HTTP basic authentication)")
    if entry.username:
        return
    if not has_certificate:
        raise APIError(
            f"{prefix} has no credentials for enrollment: set username and password (HTTP basic authentication) "
            "or est_client_pkcs12_base64 (TLS client certificate)"
        )
    if not endpoint.server.uses_tls:
        raise APIError(
            f"{prefix} authenticates with a TLS client certificate (est_client_pkcs12_base64), but pki_connection "
            f"{entry.pki_connection!r} chooses plain HTTP: write https://, or set username and password"
        )


def enrollment_tls(entry: PkiEntry, credential: pki_client.ClientCredential | None) -> tuple[ssl.SSLContext, str]:
    """TLS for enrollment, always verified, since credentials and CSRs go over it, with the host name checked:

    1. against ``tls_ca`` when the entry has one: the operator said who the server is;
    2. else against the CA certificates validate stored: RFC 7030 §3.6.1's explicit trust anchors, learnt by the
       §4.1.1 bootstrap whose fingerprints the operator confirmed; an EST CA often certifies its own server;
    3. else against the system's trust store (§3.6.2's implicit trust anchors), for a publicly certified server.

    Explicit anchors are never mixed with the system store: once the entry names its CAs, a certificate any
    public CA issued for the server's name must not be enough. Returns the context and the anchors in words.
    """
    if entry.tls_ca:
        return pki_client.ssl_context(entry, credential), "the entry's tls_ca"
    stored = pki_client.stored_ca_certificates(entry)
    if not stored:
        return pki_client.ssl_context(entry, credential), "the system's trust store (the entry has no tls_ca)"
    context = pki_client.ssl_context(entry, credential, anchors=stored)
    return context, "the EST CA certificates stored by validate (the entry has no tls_ca)"


def _unverified_tls() -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def ca_chain_order(
    certificates: list[x509.Certificate], held: list[x509.Certificate] | None = None
) -> list[x509.Certificate]:
    """CA certificates from ``/cacerts`` (a bag) as a chain, issuing CA first: the certificate that issued none
    of the others, then its issuers; anything else after them.

    While the server announces a root CA key update (RFC 7030 §4.1.3) the bag holds two roots and the certificates
    that link their keys (NewWithOld, OldWithNew). Those links are never trust anchors and are left out. Of the
    roots, the current one stays with what descends from it: the one certlm holds (``held``, the entry's chain), or
    else the one that expires first (a successor outlives the root it follows). The other, the announced root, is
    ``successor_issuer``'s: a campaign brings it to the devices, trust first, not a validate."""
    unique = list({c.fingerprint(hashes.SHA256()): c for c in certificates}.values())
    roots = [c for c in unique if is_self_signed(c)]
    if len(roots) > 1:
        root_keys = {spki_der(root.public_key()) for root in roots}
        unique = [c for c in unique if is_self_signed(c) or spki_der(c.public_key()) not in root_keys]
        held_keys = {spki_der(c.public_key()) for c in held or ()}
        current = next(
            (root for root in roots if spki_der(root.public_key()) in held_keys),
            min(roots, key=lambda root: root.not_valid_after_utc),
        )
        unique = [c for c in unique if (issuer_chain(c, unique) or [c])[-1] == current]
    bottoms = [c for c in unique if not any(o is not c and issued_by(o, c) and o.issuer != o.subject for o in unique)]
    if not bottoms:
        return unique
    # Two issuing CAs under one root (a new issuing CA announced beside the current one): the one certlm holds, else
    # the one that expires first, as for roots. The other is ``successor_issuer``'s and is left out.
    held_keys = {spki_der(c.public_key()) for c in held or ()}
    bottom = next(
        (c for c in bottoms if spki_der(c.public_key()) in held_keys),
        min(bottoms, key=lambda c: c.not_valid_after_utc),
    )
    chain = [bottom, *issuer_chain(bottom, unique)]
    beside = [c for c in bottoms if c is not bottom and (issuer_chain(c, unique) or [c])[-1] == chain[-1]]
    return chain + [c for c in unique if c not in chain and c not in beside]
