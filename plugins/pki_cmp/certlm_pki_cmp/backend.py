"""PKI type 3, ``cmp``: certificates from a plant's CA over CMP (RFC 4210/9480, lightweight profile RFC 9483).

How a PKI entry configures it:

- ``pki_connection`` is the server's ``host:port``, reached over plain HTTP (RFC 6712: CMP messages carry their
  own protection), or ``https://host:port`` (``http://host:port``) choosing the scheme; ``additional_path_segment``
  is the HTTP path of its CMP endpoint (default ``/``).
- ``username`` and ``password``: MAC protection (PasswordBasedMac, or PBMAC1 once the server answers with it),
  the username being the senderKID that names the shared secret at the CA.
- The client PKCS#12 (``est_client_pkcs12_base64``): signature protection, and the RA certificate when certlm
  acts as registration authority. When both are configured requests are signed, the stronger of the two; the
  password then still verifies MAC-protected responses.
- ``tls_ca``: the TLS trust anchors over HTTPS (else the system's trust store), and over either scheme the trust
  anchors of signature-protected responses: a signed response whose signer does not chain to them is rejected.

Credentials are checked when the entry is used, not when it is stored: an operation that must talk to the server
answers 400 naming the missing field.

What it sends (one transaction each): ``p10cr`` with the device's CSR; ``ir`` (MAC) or ``cr`` (signature) with
a CRMF template from the CSR and a signature POPO when certlm made the key; ``kur`` with the oldCertId control
for a renewal; ``rr`` to revoke; ``genm`` for id-it-caCerts. Every enrollment asks for implicit confirmation and
sends ``certConf`` unless the response grants it, polls while the CA answers ``waiting``, and refuses (certConf
with rejection) a certificate whose public key is not the requested one.

Registration authority: when the CA refuses ``p10cr`` as a request type (failInfo badRequest, badDataFormat or
systemUnavail: what CAs answer a body type they do not take; OpenSSL's server answers badRequest) and a client
PKCS#12 is configured, certlm verifies the CSR's signature itself and sends ``cr`` with POPO ``raVerified``, signed with
that certificate. A renewal with only the device's CSR is a ``kur`` with ``raVerified`` likewise.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from pyasn1_alt_modules import rfc9480

from certlm import pki_client
from certlm.certs import issued_by, issuer_chain, spki_der
from certlm.errors import APIError, CsrRejected, NotFound, UpstreamUnavailable
from certlm.registry import CertificateProfile, Enrollment, PkiBackend
from certlm.storage.models import PkiEntry
from certlm_pki_cmp import messages, protection
from certlm_pki_cmp.transaction import Credentials, ServerRefused, Transaction
from certlm_pki_cmp.transport import CmpTransport

log = logging.getLogger(__name__)

# failInfo bits with which a CA says it does not take p10cr at all (see the module docstring).
P10CR_REFUSED = frozenset({"badRequest", "badDataFormat", "systemUnavail"})


@dataclass(frozen=True)
class _Request:
    """An enrollment request ready to send: its body type, body, and the public key it asks a certificate for."""

    kind: str
    body: rfc9480.PKIBody
    public_key: bytes  # SubjectPublicKeyInfo DER
    recipient: x509.Name | None


class CmpPki(PkiBackend):
    pki_type = 3
    name = "cmp"

    def configuration_problems(self, entry: PkiEntry) -> list[str]:
        """What is malformed; what is merely missing (credentials) is reported when the entry is used."""
        if pki_client.network_connection(entry.pki_connection) is None:
            return ["a CMP entry needs pki_connection host:port with the CMP server's port (not 0)"]
        return []

    def _credentials(self, entry: PkiEntry) -> Credentials:
        """The entry's credentials, decrypted; 400 naming the field when it has none to protect a request with."""
        if not entry.est_client_pkcs12_enc:
            if not entry.password_enc:
                raise APIError(
                    f"PKI entry {entry.id} (CMP) has no password: set password (the MAC secret, with username as "
                    "senderKID) or est_client_pkcs12_base64 (a client certificate for signature protection)"
                )
            if not entry.username:
                raise APIError(
                    f"PKI entry {entry.id} (CMP) has no username: set username (the senderKID that names the MAC "
                    "secret at the CA) or est_client_pkcs12_base64 (a client certificate for signature protection)"
                )
        secret = pki_client.password(entry, self.services)
        return Credentials(
            entry_id=entry.id,
            username=entry.username,
            secret=secret.encode() if secret is not None else None,
            signer=pki_client.client_credential(entry, self.services),
            anchors=tuple(pki_client.tls_trust_anchors(entry)),
        )

    # --- enrollment ---------------------------------------------------------------------------------------------

    async def enroll(
        self,
        entry: PkiEntry,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        *,
        renewing: x509.Certificate | None = None,
        private_key: CertificateIssuerPrivateKeyTypes | None = None,
    ) -> Enrollment:
        # certlm vouches for the CSR whenever it sends raVerified, and a CA would refuse it anyway.
        if not csr.is_signature_valid:
            raise CsrRejected("CSR signature does not verify")
        if private_key is not None and spki_der(private_key.public_key()) != spki_der(csr.public_key()):
            raise CsrRejected("the private key given for the CSR is not the CSR's key")
        credentials = self._credentials(entry)
        async with CmpTransport(entry, self.services) as transport:
            request = self._request(csr, profile, credentials, renewing=renewing, private_key=private_key)
            try:
                certificate, candidates = await self._enroll(transport, credentials, request)
            except ServerRefused as refused:
                if not (request.kind == "p10cr" and set(refused.status.failures) & P10CR_REFUSED):
                    raise refused.as_api_error(entry.id, "rejected the request") from None
                if credentials.signer is None:
                    raise CsrRejected(
                        f"CMP server refused p10cr: {refused.status.describe()}; to send the CSR as a registration "
                        f"authority (cr with raVerified), give PKI entry {entry.id} a client PKCS#12 holding the RA "
                        "certificate"
                    ) from None
                log.info("CMP server of PKI entry %s refused p10cr; enrolling as registration authority", entry.id)
                request = self._request(csr, profile, credentials, registration_authority=True)
                try:
                    certificate, candidates = await self._enroll(transport, credentials, request)
                except ServerRefused as again:
                    raise again.as_api_error(entry.id, "rejected the request from certlm as RA") from None
        chain = issuer_chain(certificate, [*candidates, *pki_client.stored_ca_certificates(entry)])
        if chain and chain != pki_client.stored_ca_certificates(entry):
            await pki_client.store_ca_certificates(entry, chain)
        return Enrollment(certificate=certificate, chain=tuple(chain))

    def _request(
        self,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        credentials: Credentials,
        *,
        renewing: x509.Certificate | None = None,
        private_key: CertificateIssuerPrivateKeyTypes | None = None,
        registration_authority: bool = False,
    ) -> _Request:
        public_key = spki_der(csr.public_key())
        if renewing is None and private_key is None and not registration_authority:
            return _Request("p10cr", messages.p10cr_body(csr), public_key, None)
        # ir authenticates with the shared secret (RFC 9483 §4.1.1), cr with a certificate (§4.1.2).
        kind = "kur" if renewing is not None else "cr" if credentials.signs else "ir"
        hosts = profile.hosts if profile.name == "server" else ()
        request = messages.cert_request(csr, messages.csr_extensions(csr, hosts), old_certificate=renewing)
        if private_key is None:
            body = messages.cert_request_body(kind, request)
        else:
            algorithm = protection.signature_algorithm(private_key)
            signature = protection.sign(private_key, algorithm, messages.cert_request_der(request))
            body = messages.cert_request_body(kind, request, popo_algorithm=algorithm, popo_signature=signature)
        return _Request(kind, body, public_key, renewing.issuer if renewing is not None else None)

    async def _enroll(
        self, transport: CmpTransport, credentials: Credentials, request: _Request
    ) -> tuple[x509.Certificate, list[x509.Certificate]]:
        """One certificate transaction: request, polling while waiting, certificate checked, then confirmed.
        Returns the certificate and the CA certificates the messages carried (caPubs, extraCerts)."""
        transaction = Transaction(transport, credentials, request.recipient)
        expected = messages.CERTIFICATE_RESPONSES[request.kind]
        response = await transaction.exchange(request.body, implicit_confirm=True)
        answer, final = await self._poll(transaction, response, request.kind, expected)
        if not answer.status.granted:
            raise ServerRefused(answer.status)
        if answer.certificate is None:
            raise self._invalid(credentials, f"accepted {request.kind} but sent no certificate")
        allowed_ids = (0, -1) if request.kind == "p10cr" else (messages.CRMF_CERT_REQ_ID,)
        if answer.cert_req_id not in allowed_ids:
            raise self._invalid(credentials, f"answered certReqId {answer.cert_req_id} to {request.kind}")
        implicit = messages.grants_implicit_confirm(final)
        certificate = answer.certificate
        if spki_der(certificate.public_key()) != request.public_key:
            if not implicit:
                rejection = ("badCertTemplate", "public key of the certificate differs from the requested one")
                await self._confirm(transaction, certificate, answer.cert_req_id, rejection)
            raise self._invalid(
                credentials,
                f"issued a certificate ({certificate.subject.rfc4514_string()}, serial {certificate.serial_number:X}) "
                "for another public key than requested; certlm refused it"
                + (" (the CA granted implicit confirmation, so it counts it as accepted)" if implicit else ""),
            )
        if not implicit:
            await self._confirm(transaction, certificate, answer.cert_req_id)
        try:
            extra = messages.extra_certs(final)
        except messages.MalformedMessage as error:
            raise self._invalid(credentials, f"sent unreadable extraCerts ({error})") from None
        return certificate, [*answer.ca_pubs, *extra]

    async def _poll(
        self, transaction: Transaction, response: rfc9480.PKIMessage, sent: str, expected: str
    ) -> tuple[messages.CertificateResponse, rfc9480.PKIMessage]:
        """The final certificate response, polling (RFC 9483 §4.4) while the CA says waiting, for at most
        ``pki_pending_wait_s`` and never sooner than each pollRep's checkAfter."""
        loop = asyncio.get_running_loop()
        limit = self.services.settings.pki_pending_wait_s
        deadline = loop.time() + limit
        cert_req_id = messages.P10CR_CERT_REQ_ID if sent == "p10cr" else messages.CRMF_CERT_REQ_ID
        while True:
            received = messages.body_type(response)
            check_after = 0
            if received == "pollRep":
                poll = self._read(transaction.credentials, messages.poll_response, response)
                check_after = poll.check_after
            elif received == expected:
                answer = self._read(transaction.credentials, messages.certificate_response, response)
                if answer.status.status != messages.WAITING:
                    return answer, response
                cert_req_id = answer.cert_req_id
            else:
                raise self._invalid(transaction.credentials, f"answered {sent} with {received}, not {expected}")
            if loop.time() + check_after > deadline:
                raise UpstreamUnavailable(
                    f"CMP server of PKI entry {transaction.credentials.entry_id} has not issued the certificate "
                    f"within {limit:g} s (pki_pending_wait_s); it asked to poll again after {check_after} s"
                )
            await asyncio.sleep(check_after)
            response = await transaction.exchange(messages.poll_req_body(cert_req_id))

    async def _confirm(
        self,
        transaction: Transaction,
        certificate: x509.Certificate,
        cert_req_id: int,
        rejection: tuple[str, str] | None = None,
    ) -> None:
        response = await transaction.exchange(messages.cert_conf_body(certificate, cert_req_id, rejection))
        if messages.body_type(response) != "pkiconf":
            raise self._invalid(transaction.credentials, f"answered certConf with {messages.body_type(response)}")

    @staticmethod
    def _read(credentials: Credentials, reader, response):
        try:
            return reader(response)
        except messages.MalformedMessage as error:
            raise CmpPki._invalid(credentials, str(error)) from None

    @staticmethod
    def _invalid(credentials: Credentials, problem: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"CMP server of PKI entry {credentials.entry_id} {problem}")

    # --- revocation, CA certificates, CRL -----------------------------------------------------------------------

    async def revoke(self, entry: PkiEntry, certificate: x509.Certificate, reason: x509.ReasonFlags) -> None:
        known = pki_client.stored_ca_certificates(entry)
        if known and not any(issued_by(certificate, ca) for ca in known):
            raise APIError(
                f"certificate {certificate.subject.rfc4514_string()} was not issued by the CA of PKI entry {entry.id}"
            )
        credentials = self._credentials(entry)
        async with CmpTransport(entry, self.services) as transport:
            transaction = Transaction(transport, credentials, certificate.issuer)
            try:
                response = await transaction.exchange(messages.rr_body(certificate, reason))
                if messages.body_type(response) != "rp":
                    raise self._invalid(credentials, f"answered rr with {messages.body_type(response)}, not rp")
                status = self._read(credentials, messages.revocation_status, response)
                if not status.granted:
                    raise ServerRefused(status)
            except ServerRefused as refused:
                raise refused.as_api_error(entry.id, "refused the revocation", APIError) from None
        log.info("CMP server of PKI entry %s revoked serial %X", entry.id, certificate.serial_number)

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        stored = pki_client.stored_ca_certificates(entry)
        if stored:
            return stored
        fetched = await self._general_ca_certificates(entry)
        if not fetched:
            raise NotFound(
                f"No CA available for PKI entry {entry.id}: the CMP server sends its CA certificates with the first "
                "enrollment"
            )
        await pki_client.store_ca_certificates(entry, fetched)
        return fetched

    async def _general_ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        """The CA certificates a genm for id-it-caCerts returns (RFC 9483 §4.3.1); none when the server has no
        answer to it."""
        credentials = self._credentials(entry)
        async with CmpTransport(entry, self.services) as transport:
            transaction = Transaction(transport, credentials)
            try:
                response = await transaction.exchange(messages.genm_body(rfc9480.id_it_caCerts))
            except ServerRefused as refused:
                log.info("CMP server of PKI entry %s answered genm caCerts with %s", entry.id, refused)
                return []
        if messages.body_type(response) != "genp":
            raise self._invalid(credentials, f"answered genm with {messages.body_type(response)}, not genp")
        return self._read(
            credentials, lambda message: messages.general_certificates(message, rfc9480.id_it_caCerts), response
        )

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        stored = pki_client.stored_ca_certificates(entry)
        if not stored:
            raise NotFound(
                f"No CRL available for PKI entry {entry.id}: no CA certificate known yet; the CMP server sends them "
                "with the first enrollment"
            )
        return await pki_client.fetch_crl(pki_client.crl_urls(entry, stored), stored, self.services)
