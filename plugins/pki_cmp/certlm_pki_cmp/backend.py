"""PKI type 3, ``cmp``: certificates from a plant's CA over CMP (RFC 4210/9480, lightweight profile RFC 9483).

How a PKI entry configures it:

- ``pki_connection`` is the server's ``host:port``, reached over plain HTTP (RFC 6712: CMP messages carry their
  own protection), or ``https://host:port`` (``http://host:port``) choosing the scheme; ``additional_path_segment``
  is the HTTP path of its CMP endpoint (default ``/``).
- ``username`` and ``password``: MAC protection (PasswordBasedMac, or PBMAC1 once the server answers with it),
  the username being the senderKID that names the shared secret at the CA. ``cmp_mac_algorithm`` pins the
  PasswordBasedMac identifiers (see below); null, the default, negotiates them.
- The client PKCS#12 (``est_client_pkcs12_base64``): signature protection, and the RA certificate when certlm
  acts as registration authority. When both are configured requests are signed, the stronger of the two; the
  password then still verifies MAC-protected responses.
- ``tls_ca``: the TLS trust anchors over HTTPS (else the system's trust store), and over either scheme the trust
  anchors of signature-protected responses: a signed response whose signer does not chain to them is rejected.

Credentials are checked when the entry is used, not when it is stored: an operation that must talk to the server
answers 400 naming the missing field.

Every certificate transaction asks for implicit confirmation and sends ``certConf`` unless the response grants it,
polls while the CA answers ``waiting``, and refuses (certConf with rejection) a certificate whose public key is not
the requested one. ``rr`` revokes; ``genm`` asks for id-it-caCerts, and for a root CA key update (id-it-rootCaCert,
RFC 9483 §4.3.2) when a ``ca-rollover`` campaign asks for the successor of the root certlm holds (``rollover``).

Which request an enrollment sends: the first of these the configuration allows and the server takes.

1. For a renewal, ``kur`` with the oldCertId control.
2. ``p10cr`` with the CSR as it is.
3. When certlm made the key (the device accepts a pushed key): ``ir`` (MAC, RFC 9483 §4.1.1) or ``cr`` (signature
   protection, §4.1.2) with a signature POPO. Otherwise, when an RA certificate is configured: ``cr`` with POPO
   ``raVerified``, certlm having verified the CSR's signature itself (a ``kur`` without certlm's key carries
   raVerified likewise). Holding the key, certlm proves possession rather than vouching for it.

A server that refuses a message type (``capabilities`` says what counts as that) gets the next request; a refusal is
remembered in the entry's ``learned_capabilities`` and that type tried last for a day, so the next enrollment goes
straight to what works. Any other error ends the enrollment. When every request is refused the error names each with
the server's answer and the configuration that would give certlm another request to make (400), or says there is
none (502). ``Enrollment.via`` says which request was taken, how it was protected, and what was refused before.

A device's own key that the server takes no request for, where a key certlm made would do (``p10cr`` refused and no
RA certificate for ``cr``/``raVerified``), raises ``certlm.CertlmKeyRequired``: its ``certlm_keys_allowed`` is the
entry's ``allow_certlm_generated_keys``. A driver that can push keys then makes one and enrolls again with it; without
the permission the error names both remedies. With the permission and the refusals learned, it is raised without
asking the server again.

MAC identifiers (``transaction.MacNegotiation``). PasswordBasedMac names its one-way function and MAC by OID. certlm
sends RFC 9481's (SHA-256, HMAC-SHA256 ``1.2.840.113549.2.9``) first; a server that knows only RFC 4210's arc
(hmac-sha1 ``1.3.6.1.5.5.8.1.2``, Trustpoint 0.6 among them) answers with an error that rejects the protection
(failInfo badAlg, badMessageCheck or wrongIntegrity, or protected so that certlm cannot verify it). certlm then sends
that request once more, in a new transaction, under RFC 4210's identifiers; a verified answer confirms them, and the
entry's ``learned_capabilities`` keeps them (``mac_algorithm``), so later requests use them from the start. Answers
are verified under either identifiers, whichever the server chose. A pinned ``cmp_mac_algorithm`` is used alone.
Once the identifiers are known, an error the server protects so that certlm cannot verify it counts as a refusal of
the message type (learned), not as a failure. An answer that does not verify is reported with the server's words;
certlm suggests checking username and password only when the server's failInfo points at the credentials.

CA certificates (the cache ``PkiEntry.ca_certificates``, issuing CA first) come from each enrollment's answer
(``caPubs``, ``extraCerts``) and from ``genm``, keeping only CA certificates whose signatures chain the issued
certificate. A failing ``genm`` (a CMP error message or an HTTP error) is not fatal: the chain comes with every
enrollment. See ``CmpPki._chain`` for when the cache is refreshed; a certificate from a new root that comes without
its chain makes that root the entry's only when the CA's root CA key update, verified, announces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

from certlm import (
    APIError,
    CertificateProfile,
    CertlmKeyRequired,
    CsrRejected,
    Enrollment,
    EnrollmentRequest,
    NotFound,
    PkiBackend,
    PkiEntry,
    RootKeyUpdateRefused,
    SuccessorIssuer,
    UpstreamUnavailable,
    is_self_signed,
    issued_by,
    issuer_chain,
    new_issuing_ca,
    pki_client,
    serial_hex,
    spki_der,
)
from certlm_pki_cmp import messages, protection, rollover
from certlm_pki_cmp.asn1 import rfc9480
from certlm_pki_cmp.capabilities import LearnedCapabilities, TypeRefused, type_refusal
from certlm_pki_cmp.transaction import (
    Credentials,
    MacNegotiation,
    ProtectionRejected,
    ServerRefused,
    Transaction,
    already_revoked,
)
from certlm_pki_cmp.transport import CmpTransport, HttpErrorAnswer

log = logging.getLogger(__name__)

_Result = TypeVar("_Result")


@dataclass(frozen=True)
class _Request:
    """An enrollment request ready to send: its body type, body, the public key it asks a certificate for, and
    whether certlm vouches for the proof of possession (raVerified)."""

    kind: str
    body: rfc9480.PKIBody
    public_key: bytes  # SubjectPublicKeyInfo DER
    recipient: x509.Name | None
    ra_verified: bool = False

    def describe(self, credentials: Credentials, negotiation: MacNegotiation) -> str:
        """How it asked, for ``Enrollment.via``: ``ir with a signature POPO for the key certlm made, MAC
        rfc4210-hmac-sha1``."""
        if self.kind == "p10cr":
            how = "p10cr"
        elif self.ra_verified:
            how = f"{self.kind} with POPO raVerified" + (
                ", certlm vouching for the device's CSR as RA" if credentials.signs else ""
            )
        else:
            how = f"{self.kind} with a signature POPO for the key certlm made"
        protected = "signed with the client certificate" if credentials.signs else f"MAC {negotiation.current.name}"
        return f"{how}, {protected}"


def _valid_now(certificate: x509.Certificate, now: datetime) -> bool:
    return certificate.not_valid_before_utc <= now <= certificate.not_valid_after_utc


def _verified_chain(certificate: x509.Certificate, pool: list[x509.Certificate]) -> list[x509.Certificate]:
    """The issuers of ``certificate`` in ``pool``, each one's signature verified, issuing CA first, as far as each is
    a CA: what of a server's caPubs, extraCerts or genm answer really is the certificate's chain."""
    chain = []
    for issuer in issuer_chain(certificate, pool):
        if not protection.is_ca(issuer):
            break
        chain.append(issuer)
    return chain


def _longest_chain(certificates: list[x509.Certificate]) -> list[x509.Certificate]:
    """The longest chain of valid CA certificates, each signed by the next, among ``certificates`` (a genm answer,
    with no issued certificate to start from), issuing CA first."""
    now = datetime.now(UTC)
    authorities = [c for c in certificates if protection.is_ca(c) and _valid_now(c, now)]
    return max(([ca, *_verified_chain(ca, authorities)] for ca in authorities), key=len, default=[])


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

    async def issue(self, entry: PkiEntry, request: EnrollmentRequest) -> Enrollment:
        csr, private_key = request.csr, request.private_key
        # certlm vouches for the CSR whenever it sends raVerified, and a CA would refuse it anyway.
        if not csr.is_signature_valid:
            raise CsrRejected("CSR signature does not verify")
        if private_key is not None and spki_der(private_key.public_key()) != spki_der(csr.public_key()):
            raise CsrRejected("the private key given for the CSR is not the CSR's key")
        credentials = self._credentials(entry)
        learned = LearnedCapabilities.of(entry)
        negotiation = self._negotiation(entry, learned)
        attempts = self._requests(csr, request.profile, credentials, request.renewing, private_key)
        # A type refused within REFUSAL_LIFETIME goes last: tried again only when nothing else is left, since the
        # lesson may be stale and failing is all that not asking would achieve.
        attempts.sort(key=lambda attempt: learned.refusal(attempt.kind) is not None)
        refused: dict[str, str] = {}
        try:
            for index, attempt in enumerate(attempts):
                if private_key is None and learned.refusal(attempt.kind) is not None:
                    self._certlm_key_instead(entry, credentials, learned, refused, attempts[index:])
                try:
                    certificate, candidates = await self._enroll(entry, credentials, negotiation, attempt)
                except TypeRefused as refusal:
                    log.info("CMP server of PKI entry %s refused %s: %s", entry.id, refusal.kind, refusal.answer)
                    refused[refusal.kind] = refusal.answer
                    learned.refused(refusal.kind, refusal.answer)
                    continue
                except ServerRefused as rejected:
                    by = " from certlm as RA" if attempt.ra_verified and credentials.signs else ""
                    raise self._with_negotiation(
                        rejected.as_api_error(entry.id, f"rejected the request{by}"), negotiation
                    ) from None
                finally:
                    self._learn_mac(credentials, negotiation, learned)
                learned.accepted(attempt.kind)
                chain = await self._chain(entry, credentials, negotiation, learned, certificate, candidates)
                via = attempt.describe(credentials, negotiation) + "".join(
                    f"; the server refused {kind} ({answer})" for kind, answer in refused.items()
                )
                return Enrollment(certificate=certificate, chain=tuple(chain), via=via)
        finally:
            await learned.save(entry)
        raise self._nothing_accepted(entry, credentials, refused, private_key)

    @staticmethod
    def _negotiation(entry: PkiEntry, learned: LearnedCapabilities) -> MacNegotiation:
        """The MAC identifiers to protect with: the entry's pinned ones alone, else those learned to work first
        (confirmed), else RFC 9481's first (``MacNegotiation``)."""
        pinned = protection.MAC_ALGORITHMS.get(entry.cmp_mac_algorithm or "")
        if pinned is not None:
            return MacNegotiation((pinned,))
        preferred = (protection.RFC9481_HMAC_SHA256, protection.RFC4210_HMAC_SHA1)
        known = learned.mac_algorithm()
        if known is None:
            return MacNegotiation(preferred)
        return MacNegotiation((known, *(algorithm for algorithm in preferred if algorithm != known)), confirmed=True)

    @staticmethod
    def _learn_mac(credentials: Credentials, negotiation: MacNegotiation, learned: LearnedCapabilities) -> None:
        if negotiation.confirmed and not credentials.signs:
            learned.mac_worked(negotiation.current, negotiation.refused)

    @staticmethod
    def _with_negotiation(error: APIError, negotiation: MacNegotiation) -> APIError:
        """``error``, naming what the server answered to each MAC identifiers when certlm tried more than one and
        none worked."""
        if negotiation.confirmed or len(negotiation.answers) < 2:
            return error
        tried = "; ".join(f"{name}: {answer}" for name, answer in negotiation.answers.items())
        error.message += f" (certlm sent the request under each of its MAC identifiers, answered {tried})"
        error.args = (error.message,)
        return error

    def _certlm_key_instead(
        self,
        entry: PkiEntry,
        credentials: Credentials,
        learned: LearnedCapabilities,
        refused: dict[str, str],
        remaining: list[_Request],
    ) -> None:
        """Raise ``CertlmKeyRequired`` rather than send the ``remaining`` requests for the device's own key, all
        refused within ``REFUSAL_LIFETIME``, when the entry allows keys certlm makes and the server did not refuse the
        request for one: each push would otherwise cost requests the server refuses. Without that permission they
        are sent (the server may have been upgraded), as the last resort they are."""
        pushed_kind = "cr" if credentials.signs else "ir"
        if not entry.allow_certlm_generated_keys or pushed_kind in refused or learned.refusal(pushed_kind):
            return
        lessons = {attempt.kind: learned.refusal(attempt.kind) or {} for attempt in remaining}
        answers = {kind: f"{lesson.get('answer')}, learned {lesson.get('at')}" for kind, lesson in lessons.items()}
        raise self._certlm_key_required(entry, credentials, {**refused, **answers})

    def _requests(
        self,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        credentials: Credentials,
        renewing: x509.Certificate | None,
        private_key: CertificateIssuerPrivateKeyTypes | None,
    ) -> list[_Request]:
        """What certlm can send for ``csr``, in the order of the module docstring."""
        requests = []
        if renewing is not None:
            requests.append(self._crmf_request("kur", csr, profile, private_key, renewing))
        requests.append(_Request("p10cr", messages.p10cr_body(csr), spki_der(csr.public_key()), None))
        if private_key is not None:
            requests.append(self._crmf_request("cr" if credentials.signs else "ir", csr, profile, private_key))
        elif credentials.signs:
            requests.append(self._crmf_request("cr", csr, profile, None))
        return requests

    @staticmethod
    def _crmf_request(
        kind: str,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        private_key: CertificateIssuerPrivateKeyTypes | None,
        renewing: x509.Certificate | None = None,
    ) -> _Request:
        """An ir, cr or kur with a CRMF template from the CSR: a signature POPO made with ``private_key``, else
        raVerified."""
        hosts = profile.hosts if profile.name == "server" else ()
        request = messages.cert_request(csr, messages.csr_extensions(csr, hosts), old_certificate=renewing)
        if private_key is None:
            body = messages.cert_request_body(kind, request)
        else:
            algorithm = protection.signature_algorithm(private_key)
            signature = protection.sign(private_key, algorithm, messages.cert_request_der(request))
            body = messages.cert_request_body(kind, request, popo_algorithm=algorithm, popo_signature=signature)
        recipient = renewing.issuer if renewing is not None else None
        return _Request(kind, body, spki_der(csr.public_key()), recipient, ra_verified=private_key is None)

    def _nothing_accepted(
        self,
        entry: PkiEntry,
        credentials: Credentials,
        refused: dict[str, str],
        private_key: CertificateIssuerPrivateKeyTypes | None,
    ) -> APIError:
        """The error when the server refused every request certlm could make: ``CertlmKeyRequired`` when a key
        certlm makes would give it another, 400 naming the configuration that would, 502 when there is none."""
        answers = "; ".join(f"{kind} ({answer})" for kind, answer in refused.items())
        said = f"CMP server of PKI entry {entry.id} refused every request certlm could make: {answers}"
        # A key certlm makes lets it send ir (MAC) or cr (signed): worth it unless the server refused that type.
        pushed_kind = "cr" if credentials.signs else "ir"
        if private_key is None and pushed_kind not in refused:
            return self._certlm_key_required(entry, credentials, refused)
        if not credentials.signs:
            popo = "a signature POPO" if private_key is not None else "raVerified"
            return APIError(
                f"{said}. To enroll, configure an RA certificate (est_client_pkcs12_base64) so that certlm sends cr "
                f"with {popo}"
            )
        return UpstreamUnavailable(
            f"{said}. certlm has no other request to make: check that additional_path_segment names the server's CMP "
            "endpoint for enrollment and that the server accepts certlm's credentials (some servers, OpenSSL's "
            "among them, answer those with badRequest too)"
        )

    def _certlm_key_required(
        self, entry: PkiEntry, credentials: Credentials, refused: dict[str, str]
    ) -> CertlmKeyRequired:
        """The server takes no request for the device's own key, but would take ir (cr when certlm signs) for a key
        certlm makes: the message names the remedies, the permission the entry gives or lacks."""
        answers = "; ".join(f"{kind} ({answer})" for kind, answer in refused.items())
        pushed_kind = "cr" if credentials.signs else "ir"
        said = f"CMP server of PKI entry {entry.id} refused every request certlm could make for the device's own key: "
        if entry.allow_certlm_generated_keys:
            remedy = (
                f"PKI entry {entry.id} allows keys certlm makes (allow_certlm_generated_keys), for a device that takes "
                f"a pushed key: certlm makes one and enrolls it with {pushed_kind} and a signature POPO"
            ) + (
                ""
                if credentials.signs
                else "; for one that does not, configure an RA certificate "
                "(est_client_pkcs12_base64) so that certlm sends cr with raVerified"
            )
        else:
            remedy = "To enroll, " + ", or ".join(
                ([] if credentials.signs else [
                    "configure an RA certificate (est_client_pkcs12_base64) so that certlm sends cr with raVerified"
                ]) + [
                    f"allow keys certlm makes on the PKI entry (PATCH /pki/inventory/{entry.id} "
                    f'{{"allow_certlm_generated_keys": true}}) so that certlm makes the key, sends {pushed_kind} with '
                    "a signature POPO and pushes the key to the device with the certificate"
                ]
            )  # fmt: skip
        return CertlmKeyRequired(
            f"{said}{answers}. {remedy}",
            pki_id=entry.id,
            refused=answers,
            certlm_keys_allowed=entry.allow_certlm_generated_keys,
        )

    async def _in_transaction(
        self,
        entry: PkiEntry,
        credentials: Credentials,
        negotiation: MacNegotiation,
        work: Callable[[Transaction], Awaitable[_Result]],
        recipient: x509.Name | None = None,
    ) -> _Result:
        """``work`` in a transaction over a connection of its own (servers close theirs when a transaction ends,
        OpenSSL's among them); done once more, in a new transaction, when the server rejects the MAC protection of
        its first request and the negotiation has other identifiers (``ProtectionRejected``)."""
        while True:
            async with CmpTransport(entry, self.services) as transport:
                try:
                    return await work(Transaction(transport, credentials, negotiation, recipient))
                except ProtectionRejected:
                    log.info(
                        "CMP server of PKI entry %s: sending again under the MAC identifiers %s",
                        entry.id, negotiation.current.name,
                    )  # fmt: skip

    async def _enroll(
        self, entry: PkiEntry, credentials: Credentials, negotiation: MacNegotiation, request: _Request
    ) -> tuple[x509.Certificate, list[x509.Certificate]]:
        """One certificate transaction: request, polling while waiting, certificate checked, then confirmed. Returns
        the certificate and the CA certificates the messages carried (caPubs, extraCerts). ``TypeRefused`` when the
        answer to the request itself refuses its message type."""
        return await self._in_transaction(
            entry, credentials, negotiation, lambda transaction: self._transact(transaction, request), request.recipient
        )

    async def _transact(
        self, transaction: Transaction, request: _Request
    ) -> tuple[x509.Certificate, list[x509.Certificate]]:
        credentials = transaction.credentials
        expected = messages.CERTIFICATE_RESPONSES[request.kind]
        try:
            response = await transaction.exchange(request.body, implicit_confirm=True)
        except ProtectionRejected:
            raise
        except (ServerRefused, HttpErrorAnswer) as error:
            refusal = type_refusal(error, transaction.protection_known)
            if refusal is None:
                raise
            raise TypeRefused(request.kind, refusal) from None
        answer, final = await self._poll(transaction, response, request.kind, expected)
        if not answer.status.granted:
            rejected = ServerRefused(answer.status)
            # Only the request's own answer can refuse its type: a CA that had it polled took the type.
            refusal = type_refusal(rejected) if final is response else None
            if refusal is not None:
                raise TypeRefused(request.kind, refusal)
            raise rejected
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
                f"issued a certificate ({certificate.subject.rfc4514_string()}, serial {serial_hex(certificate)}) "
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

    async def _chain(
        self,
        entry: PkiEntry,
        credentials: Credentials,
        negotiation: MacNegotiation,
        learned: LearnedCapabilities,
        certificate: x509.Certificate,
        candidates: list[x509.Certificate],
    ) -> list[x509.Certificate]:
        """The issued certificate's chain, issuing CA first, from the answer's CA certificates and the cache; stored
        as the entry's CA certificates when it differs from them.

        When the cache is refreshed, and why:
        - By every enrollment, from its own answer: that answer is authenticated and names the CA that issues now,
          so a CA that rolled over is picked up by the first enrollment after it, without a timer.
        - By genm when the issued certificate's issuer is in neither the answer nor the cache (a CA that rolled over
          and sends no chain), unless the server refused genm within ``REFUSAL_LIFETIME``.
        - By genm in ``ca_certificates`` when the cache is empty or holds an expired certificate. A valid cache is
          not asked about again on a timer: the host asks for the CA certificates before every push, and a genm
          each time would only repeat what the enrollment's answer says anyway.
        """
        cached = self._cached_chain(entry)
        chain = _verified_chain(certificate, [*candidates, *cached])
        if not chain and not is_self_signed(certificate) and learned.refusal("genm") is None:
            fetched = await self._genm(entry, credentials, negotiation, learned)
            chain = _verified_chain(certificate, [*candidates, *fetched, *cached])
        if not chain and cached and not is_self_signed(certificate) and learned.refusal("genm") is None:
            chain = await self._announced_issuer(entry, credentials, negotiation, certificate)
        if chain and chain != pki_client.stored_ca_certificates(entry):
            await pki_client.store_ca_certificates(entry, chain)
        return chain

    async def _announced_issuer(
        self, entry: PkiEntry, credentials: Credentials, negotiation: MacNegotiation, certificate: x509.Certificate
    ) -> list[x509.Certificate]:
        """The announced new root as the chain of ``certificate`` when it issued it: a CA that issues from its new
        root and sends no chain. The new root is taken only as ``successor_issuer`` verifies it (newWithOld under
        the held root's key), so that the entry's chain, and with it every device's trust list, follows the CA
        after a rollover; an enrollment's answer alone does not make a new root. Empty when nothing verifies."""
        try:
            new_root = await self._announced_root(entry, credentials, negotiation)
        except APIError as error:
            log.info(
                "PKI entry %s: no verified new root CA for %s: %s", entry.id, serial_hex(certificate), error.message
            )
            return []
        return [new_root] if issued_by(certificate, new_root) else []

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
        known = self._cached_chain(entry)
        if known and not any(issued_by(certificate, ca) for ca in known):
            raise APIError(
                f"certificate {certificate.subject.rfc4514_string()} was not issued by the CA of PKI entry {entry.id}"
            )
        credentials = self._credentials(entry)
        learned = LearnedCapabilities.of(entry)
        negotiation = self._negotiation(entry, learned)

        already: list[messages.Status] = []

        async def revoked(transaction: Transaction) -> None:
            response = await transaction.exchange(messages.rr_body(certificate, reason))
            if messages.body_type(response) != "rp":
                raise self._invalid(credentials, f"answered rr with {messages.body_type(response)}, not rp")
            status = self._read(credentials, messages.revocation_status, response)
            if status.granted:
                return
            if already_revoked(status):
                already.append(status)
                return
            raise ServerRefused(status)

        try:
            await self._in_transaction(entry, credentials, negotiation, revoked, certificate.issuer)
        except ServerRefused as refused:
            raise self._with_negotiation(
                refused.as_api_error(entry.id, "refused the revocation", APIError), negotiation
            ) from None
        finally:
            self._learn_mac(credentials, negotiation, learned)
            await learned.save(entry)
        if already:
            log.info("CMP server of PKI entry %s has serial %s revoked already: %s", entry.id, serial_hex(certificate),
                     already[0].describe())  # fmt: skip
        else:
            log.info("CMP server of PKI entry %s revoked serial %s", entry.id, serial_hex(certificate))

    @staticmethod
    def _cached_chain(entry: PkiEntry) -> list[x509.Certificate]:
        """The CA certificates stored for the entry while every one is valid; none once one has expired (its CA has
        moved on: time to ask again)."""
        stored = pki_client.stored_ca_certificates(entry)
        now = datetime.now(UTC)
        return stored if all(_valid_now(certificate, now) for certificate in stored) else []

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        """The cached chain; else what genm delivers, cached. ``NotFound`` while none is known: then the host uses
        the chain an enrollment brings."""
        cached = self._cached_chain(entry)
        if cached:
            return cached
        learned = LearnedCapabilities.of(entry)
        if learned.refusal("genm") is None:
            credentials = self._credentials(entry)
            negotiation = self._negotiation(entry, learned)
            try:
                chain = _longest_chain(await self._genm(entry, credentials, negotiation, learned))
            finally:
                self._learn_mac(credentials, negotiation, learned)
                await learned.save(entry)
            if chain:
                await pki_client.store_ca_certificates(entry, chain)
                return chain
        refusal = learned.refusal("genm")
        if refusal is not None:
            raise NotFound(
                f"No CA available for PKI entry {entry.id}: the CMP server refused genm ({refusal['answer']}, "
                f"{refusal['at']}); it sends its CA certificates with the first enrollment"
            )
        raise NotFound(
            f"No CA available for PKI entry {entry.id}: the CMP server sends its CA certificates with the first "
            "enrollment"
        )

    async def _genm(
        self, entry: PkiEntry, credentials: Credentials, negotiation: MacNegotiation, learned: LearnedCapabilities
    ) -> list[x509.Certificate]:
        """The CA certificates a genm for id-it-caCerts returns (RFC 9483 §4.3.1). None when the server answers
        with a CMP error message or an HTTP error: not fatal, since every enrollment brings the chain as well; a
        refusal of the type is learned."""

        async def asked(transaction: Transaction) -> rfc9480.PKIMessage:
            return await transaction.exchange(messages.genm_body(rfc9480.id_it_caCerts))

        try:
            response = await self._in_transaction(entry, credentials, negotiation, asked)
        except (ServerRefused, HttpErrorAnswer) as error:
            refusal = type_refusal(error, credentials.signs or negotiation.confirmed)
            if refusal is not None:
                learned.refused("genm", refusal)
            log.info("CMP server of PKI entry %s answered genm caCerts with %s", credentials.entry_id, refusal or error)
            return []
        if messages.body_type(response) != "genp":
            raise self._invalid(credentials, f"answered genm with {messages.body_type(response)}, not genp")
        learned.accepted("genm")
        return self._read(
            credentials, lambda message: messages.general_certificates(message, rfc9480.id_it_caCerts), response
        )

    async def successor_issuer(self, entry: PkiEntry) -> SuccessorIssuer:
        """The new root CA key the CMP server announces for the root certlm holds (RFC 9483 §4.3.2: genm with
        id-it-rootCaCert, answered with id-it-rootCaKeyUpdate), verified (``rollover``), with its CRL where its
        distribution points deliver one. The entry stays as it is: the campaign's old issuer is the chain it holds,
        and the first enrollment from the new root makes that the entry's chain (``_chain``). Without a new root, a
        new issuing CA under the held root that a genm id-it-caCerts hands out (``_new_issuing_ca``). 409 when the
        server announces nothing new or certlm holds no CA yet; 502 when it cannot be reached, refuses the genm, or
        announces a root that does not verify."""
        credentials = self._credentials(entry)
        learned = LearnedCapabilities.of(entry)
        negotiation = self._negotiation(entry, learned)
        try:
            try:
                new_root = await self._announced_root(entry, credentials, negotiation)
            except APIError as nothing:
                if nothing.status != 409 or not pki_client.stored_ca_certificates(entry):
                    raise
                return await self._new_issuing_ca(entry, credentials, negotiation, learned, nothing)
        finally:
            self._learn_mac(credentials, negotiation, learned)
            await learned.save(entry)
        crls: tuple[x509.CertificateRevocationList, ...] = ()
        try:
            crls = (await pki_client.fetch_crl(pki_client.cdp_urls(new_root), [new_root], self.services),)
        except APIError as error:
            # A root that has issued nothing yet may publish no CRL; the reissue phase fetches each chain's CRLs.
            log.info("PKI entry %s: no CRL of the announced root CA yet: %s", entry.id, error.message)
        held_root = pki_client.stored_ca_certificates(entry)[-1]
        how = (
            f"the CMP server of PKI entry {entry.id} announced the new root CA {rollover.describe(new_root)} in "
            f"answer to genm id-it-rootCaCert (RFC 9483 §4.3.2), linked to the root CA certlm holds, "
            f"{rollover.describe(held_root)}, by a newWithOld certificate its key signed; PKI entry {entry.id} "
            "issues from it once the CA does"
        )
        log.info("PKI entry %s: %s", entry.id, how)
        return SuccessorIssuer(pki_id=entry.id, chain=(new_root,), crls=crls, how=how)

    async def _new_issuing_ca(
        self,
        entry: PkiEntry,
        credentials: Credentials,
        negotiation: MacNegotiation,
        learned: LearnedCapabilities,
        nothing: APIError,
    ) -> SuccessorIssuer:
        """A new issuing CA under the root the entry holds, among the CA certificates a genm id-it-caCerts returns
        (RFC 9483 §4.3.1), verified by certlm's ``new_issuing_ca``; ``nothing`` (409) when there is none."""
        held = pki_client.stored_ca_certificates(entry)
        where = f"the CMP server of PKI entry {entry.id}"
        try:
            chain = new_issuing_ca(held, await self._genm(entry, credentials, negotiation, learned), where=where)
        except RootKeyUpdateRefused as refused:
            raise UpstreamUnavailable(str(refused)) from None
        if chain is None:
            raise APIError(f"{nothing.message}, and no new issuing CA under it in answer to genm id-it-caCerts", 409)
        crls: tuple[x509.CertificateRevocationList, ...] = ()
        try:
            crls = (await pki_client.fetch_crl(pki_client.cdp_urls(chain[0]), list(chain[1:]), self.services),)
        except APIError as error:
            log.info("PKI entry %s: no CRL for the announced issuing CA yet: %s", entry.id, error.message)
        how = (
            f"{where} hands out the new issuing CA {rollover.describe(chain[0])} (genm id-it-caCerts, RFC 9483 "
            f"§4.3.1), issued under the root CA certlm holds, {rollover.describe(held[-1])}, which both chains share "
            f"and the campaign keeps; PKI entry {entry.id} issues from it once the CA does"
        )
        log.info("PKI entry %s: %s", entry.id, how)
        return SuccessorIssuer(pki_id=entry.id, chain=chain, crls=crls, how=how)

    async def _announced_root(
        self, entry: PkiEntry, credentials: Credentials, negotiation: MacNegotiation
    ) -> x509.Certificate:
        """The new root the server announces for the root the entry holds, verified; ``APIError`` 409 or 502."""
        held = pki_client.stored_ca_certificates(entry)
        if not held:
            raise APIError(
                f"PKI entry {entry.id} (CMP) holds no CA certificates to verify an announced root CA against: certlm "
                f"learns them from the first enrollment's answer, or from genm through GET /pki/ca/{entry.id}",
                409,
            )
        held_root = held[-1]

        async def asked(transaction: Transaction) -> rfc9480.PKIMessage:
            return await transaction.exchange(messages.root_ca_cert_genm_body(held_root))

        try:
            response = await self._in_transaction(entry, credentials, negotiation, asked)
        except ServerRefused as refused:
            raise self._with_negotiation(
                refused.as_api_error(entry.id, "refused the genm for a root CA key update", UpstreamUnavailable),
                negotiation,
            ) from None
        if messages.body_type(response) != "genp":
            raise self._invalid(credentials, f"answered genm with {messages.body_type(response)}, not genp")
        update = self._read(credentials, messages.root_ca_key_update, response)
        try:
            return rollover.verified_successor(
                held_root, update, datetime.now(UTC), f"the CMP server of PKI entry {entry.id}"
            )
        except rollover.NothingAnnounced as nothing:
            raise APIError(str(nothing), 409) from None
        except rollover.AnnouncementRefused as refused:
            raise UpstreamUnavailable(str(refused)) from None

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        known = self._cached_chain(entry)
        if not known:
            raise NotFound(
                f"No CRL available for PKI entry {entry.id}: no CA certificate known yet; the CMP server sends them "
                "with the first enrollment"
            )
        return await pki_client.fetch_crl(pki_client.crl_urls(entry, known), known, self.services)
