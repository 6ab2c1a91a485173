"""One CMP transaction (RFC 9483 §3): the requests of one transactionID, each protected, each response checked
(transactionID, recipNonce, MAC or signature) before certlm believes a word of it; and the negotiation of the MAC
identifiers its requests are protected with (``MacNegotiation``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cryptography import x509

from certlm import APIError, CsrRejected, UpstreamUnavailable, pki_client
from certlm_pki_cmp import messages, protection
from certlm_pki_cmp.asn1 import rfc9480
from certlm_pki_cmp.messages import Status
from certlm_pki_cmp.protection import MacAlgorithm
from certlm_pki_cmp.transport import CmpTransport

log = logging.getLogger(__name__)

# failInfo bits saying the server did not accept the credentials the request was protected with (RFC 9483 §3.6.4):
# the only answers that make certlm suggest checking username and password.
CREDENTIAL_FAILURES = frozenset({"badMessageCheck", "wrongIntegrity", "signerNotTrusted"})
# failInfo bits saying the server rejected the protection of a MAC-protected request: its algorithm (badAlg) or its
# value (badMessageCheck, wrongIntegrity), which a server that does not know the MAC identifiers cannot check.
PROTECTION_FAILURES = frozenset({"badAlg", "badMessageCheck", "wrongIntegrity"})
# failInfo bits saying the server itself is not working.
SERVER_FAILURES = frozenset({"systemUnavail", "systemFailure"})


def already_revoked(status: Status) -> bool:
    """Whether a refused rr says the certificate is revoked already, so the revocation wanted is in place (a retry
    after an rp that was lost on the way, say): failInfo certRevoked (RFC 4210 §5.2.3, "the certificate has already
    been revoked"), or, from a server that sets no such bit, its text saying "already revoked"."""
    return "certRevoked" in status.failures or "already revoked" in status.text.lower()


@dataclass(frozen=True)
class Credentials:
    """How one PKI entry authenticates to its CMP server and the server to it.

    Requests are signed with ``signer`` when there is one (signature protection is the stronger: the shared
    secret never proves more than knowledge of a password), else MAC-protected with ``secret`` and ``username``
    as senderKID. Responses are verified whichever way the server protected them: a MAC with ``secret``, a
    signature with a signer chaining to ``anchors`` (the entry's ``tls_ca``).
    """

    entry_id: int
    username: str | None
    secret: bytes | None = field(repr=False)
    signer: pki_client.ClientCredential | None
    anchors: tuple[x509.Certificate, ...]

    @property
    def signs(self) -> bool:
        return self.signer is not None


class ServerRefused(Exception):
    """The server answered with an error message or a negative status: ``status`` says why. An error message certlm
    could not verify, which anyone on the path could have sent, is ``unprotected`` or has a ``protection_failure``
    (why its MAC or signature does not verify)."""

    def __init__(self, status: Status, *, unprotected: bool = False, protection_failure: str | None = None) -> None:
        super().__init__(status.describe())
        self.status = status
        self.unprotected = unprotected
        self.protection_failure = protection_failure

    @property
    def unverified_note(self) -> str:
        """`` (unprotected answer)`` or `` (protection does not verify)`` after the server's words; empty when they
        verified."""
        if self.unprotected:
            return " (unprotected answer)"
        return " (protection does not verify)" if self.protection_failure is not None else ""

    @property
    def said(self) -> str:
        """The server's words as they are shown and stored: bounded and sanitised, marked when unverified."""
        return replace(self.status, text=pki_client.answer_text(self.status.text)).describe() + self.unverified_note

    @property
    def points_at_credentials(self) -> bool:
        """Whether the server's failInfo says it did not accept certlm's credentials."""
        return bool(set(self.status.failures) & CREDENTIAL_FAILURES)

    def as_api_error(self, entry_id: int, refused: str, rejected: type[APIError] = CsrRejected) -> APIError:
        """The error a client of certlm sees: credentials, an answer that does not verify, or server trouble as 502,
        a refusal as ``rejected``. It suggests checking the credentials only when the server's failInfo says so."""
        detail = self.status.describe() + self.unverified_note
        failures = set(self.status.failures)
        check = "; check username and password or the client PKCS#12" if self.points_at_credentials else ""
        if self.protection_failure is not None:
            return UpstreamUnavailable(
                f"CMP server of PKI entry {entry_id} answered with an error message that certlm cannot verify "
                f"({self.protection_failure}); the server said, unverified: {self.status.describe()}{check}"
            )
        if failures & CREDENTIAL_FAILURES:
            return UpstreamUnavailable(
                f"CMP server did not accept the credentials of PKI entry {entry_id}: {detail}{check}"
            )
        if failures & SERVER_FAILURES:
            return UpstreamUnavailable(f"CMP server of PKI entry {entry_id} is not available: {detail}")
        return rejected(f"CMP server {refused}: {detail}")


class ProtectionRejected(ServerRefused):
    """The error answer to the first request of a transaction that rejects its MAC protection, while the
    ``MacNegotiation`` has other identifiers to send it with: the caller sends the request again, in a new transaction
    (a server may keep the refused one's transactionID)."""


def rejects_protection(refused: ServerRefused) -> bool:
    """Whether an error answer to a MAC-protected request says the server did not take its protection: it names
    ``PROTECTION_FAILURES``, or it is protected in a way certlm cannot verify with the password (a server that could
    not check certlm's MAC cannot compute one certlm can; Trustpoint 0.6 signs such answers with a key of its own)."""
    return refused.protection_failure is not None or bool(set(refused.status.failures) & PROTECTION_FAILURES)


class MacNegotiation:
    """The PasswordBasedMac identifiers (``protection.MacAlgorithm``) the transactions of one operation use, as
    certlm negotiates them with a server, the way it negotiates message types.

    ``candidates`` are tried in order: the entry's pinned identifiers alone, else those learned to work with this
    server (``confirmed``), else RFC 9481's, then RFC 4210's. While none is confirmed, an error answer to the first
    request of a transaction that rejects its protection (``rejects_protection``) makes certlm send that request once
    more, in a new transaction, with the next identifiers; when that one is answered alike, the error stands, naming
    both answers. A verified answer that is no error confirms the identifiers in use; the caller then records them
    (``LearnedCapabilities.mac_worked``)."""

    def __init__(self, candidates: Sequence[MacAlgorithm], *, confirmed: bool = False) -> None:
        self.candidates = tuple(candidates)
        self.current = self.candidates[0]
        self.confirmed = confirmed
        self.retried = False
        # The server's answer under each identifiers it rejected, for what is learned and shown.
        self.answers: dict[str, str] = {}

    def confirm(self, algorithm: MacAlgorithm) -> None:
        if algorithm == self.current:
            self.confirmed = True

    def rejected(self, algorithm: MacAlgorithm, answer: str) -> bool:
        """Whether to send the request again with other identifiers (now ``current``) after the server answered
        ``answer`` to it under ``algorithm`` and the answer rejects the protection: once, while none is confirmed."""
        if self.confirmed or algorithm != self.current:
            return False
        self.answers[algorithm.name] = answer
        untried = [candidate for candidate in self.candidates if candidate.name not in self.answers]
        if self.retried or not untried:
            return False
        self.retried = True
        self.current = untried[0]
        return True

    @property
    def refused(self) -> dict[str, str]:
        """What the server answered to the identifiers it rejected before ``current`` worked."""
        return {name: answer for name, answer in self.answers.items() if name != self.current.name}


class Transaction:
    """Requests and responses sharing one transactionID, the nonces chained from each response to the next
    request. A PBMAC1-protected response switches the rest of the transaction to PBMAC1 (RFC 9481 §6.1.2)."""

    def __init__(
        self,
        transport: CmpTransport,
        credentials: Credentials,
        negotiation: MacNegotiation,
        recipient: x509.Name | None = None,
    ) -> None:
        self.transport = transport
        self.credentials = credentials
        self.negotiation = negotiation
        self.mac = negotiation.current
        self.recipient = recipient
        self.transaction_id = messages.nonce()
        self._recip_nonce: bytes | None = None
        self._pbmac1 = False
        self._answered = False

    @property
    def protection_known(self) -> bool:
        """Whether the server is known to verify how certlm protects: signatures, or MAC identifiers confirmed. An
        error answer it protects so that certlm cannot verify it is then its own fault, not a rejected protection."""
        return self.credentials.signs or self.negotiation.confirmed

    def _unavailable(self, problem: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"CMP server of PKI entry {self.credentials.entry_id}: {problem}")

    def _protect(self, body: rfc9480.PKIBody, sender_nonce: bytes, implicit_confirm: bool) -> bytes:
        credentials = self.credentials
        if credentials.signer is not None:
            algorithm = protection.signature_algorithm(credentials.signer.private_key)
            sender = credentials.signer.certificate.subject
            sender_kid = protection.key_identifier(credentials.signer.certificate)
        else:
            algorithm = (
                protection.pbmac1_algorithm() if self._pbmac1 else protection.password_based_mac_algorithm(self.mac)
            )
            sender = None
            sender_kid = (credentials.username or "").encode()
        header = messages.header(
            sender=sender,
            recipient=self.recipient,
            transaction_id=self.transaction_id,
            sender_nonce=sender_nonce,
            recip_nonce=self._recip_nonce,
            sender_kid=sender_kid,
            protection_algorithm=algorithm,
            implicit_confirm=implicit_confirm,
        )
        message = messages.message(header, body)
        data = messages.protected_part(message)
        if credentials.signer is not None:
            signature = protection.sign(credentials.signer.private_key, algorithm, data)
            # RFC 9483 §3.3: the signer's certificate first in extraCerts, then its chain.
            messages.set_protection(message, signature, (credentials.signer.certificate, *credentials.signer.chain))
        else:
            messages.set_protection(message, protection.mac(credentials.secret or b"", algorithm, data))
        return messages.encode(message)

    async def exchange(self, body: rfc9480.PKIBody, *, implicit_confirm: bool = False) -> rfc9480.PKIMessage:
        """Send ``body`` and return the verified response; ``ServerRefused`` for an error message (verified or not),
        ``ProtectionRejected`` when it answers the transaction's first request by rejecting its MAC and the
        negotiation has other identifiers to send it with."""
        sender_nonce = messages.nonce()
        sent = body.getName()
        answer = await self.transport.post(self._protect(body, sender_nonce, implicit_confirm))
        try:
            response = messages.decode(answer)
        except messages.MalformedMessage as error:
            raise self._unavailable(f"answered {sent} with something that is not a CMP message ({error})") from None
        received = messages.body_type(response)
        log.info("CMP %s answered with %s for PKI entry %s", sent, received, self.credentials.entry_id)
        header = response["header"]
        if messages.octets(header["transactionID"]) != self.transaction_id:
            raise self._unavailable(f"answered {sent} with a message of another transaction (transactionID)")
        recip_nonce = messages.octets(header["recipNonce"])
        if recip_nonce != sender_nonce and not (received == "error" and recip_nonce is None):
            raise self._unavailable(f"answered {sent} with a recipNonce that is not the request's senderNonce")
        first = not self._answered
        self._answered = True
        if received != "error":
            self._verify(response, sent)
            self._recip_nonce = messages.octets(header["senderNonce"])
            if not self.credentials.signs:
                self.negotiation.confirm(self.mac)
            return response
        self._recip_nonce = messages.octets(header["senderNonce"])
        refused = self._error(response, sent)
        if first and not self.credentials.signs and rejects_protection(refused):
            said = refused.said
            if self.negotiation.rejected(self.mac, said):
                log.info(
                    "CMP server of PKI entry %s rejected the protection of %s under %s: %s",
                    self.credentials.entry_id, sent, self.mac.name, said,
                )  # fmt: skip
                raise ProtectionRejected(
                    refused.status, unprotected=refused.unprotected, protection_failure=refused.protection_failure
                )
        raise refused

    def _error(self, response: rfc9480.PKIMessage, sent: str) -> ServerRefused:
        """The error message as ``ServerRefused``, marked when certlm cannot verify it: a server may protect an error
        so that no one can (it could not check certlm's MAC, or it signs with a key of its own)."""
        status = messages.error_status(response)
        if not self._protected(response):
            return ServerRefused(status, unprotected=True)
        try:
            self._check_protection(response, sent)
        except _Unverifiable as unverifiable:
            return ServerRefused(status, protection_failure=unverifiable.reason)
        return ServerRefused(status)

    @staticmethod
    def _protected(response: rfc9480.PKIMessage) -> bool:
        return response["header"]["protectionAlg"].isValue and messages.protection_bytes(response) is not None

    def _verify(self, response: rfc9480.PKIMessage, sent: str) -> None:
        """Check the response's protection; ``UpstreamUnavailable`` naming why it does not verify."""
        try:
            self._check_protection(response, sent)
        except _Unverifiable as unverifiable:
            raise self._unavailable(unverifiable.message) from None

    def _check_protection(self, response: rfc9480.PKIMessage, sent: str) -> None:
        if not self._protected(response):
            raise _Unverifiable("no protection", f"answered {sent} without protection; certlm accepts none")
        algorithm = response["header"]["protectionAlg"]
        signature = messages.protection_bytes(response)
        data = messages.protected_part(response)
        credentials = self.credentials
        if protection.is_mac(algorithm):
            if credentials.secret is None:
                raise _Unverifiable(
                    "MAC-protected, but the entry has no password",
                    f"answered {sent} MAC-protected, but PKI entry {credentials.entry_id} has no password to verify it",
                )
            try:
                protection.verify_mac(credentials.secret, algorithm, data, signature)
            except protection.ProtectionFailure as failure:
                raise _Unverifiable(
                    f"{failure} with the password of PKI entry {credentials.entry_id}",
                    f"the answer to {sent} does not verify with the password of PKI entry {credentials.entry_id} "
                    f"({failure}): the server protects its answers with another secret, or the answer was altered",
                ) from None
            self._pbmac1 = self._pbmac1 or protection.is_pbmac1(algorithm)
            return
        self._check_signature(response, sent, algorithm, data, signature)

    def _check_signature(self, response, sent: str, algorithm, data: bytes, signature: bytes) -> None:
        credentials = self.credentials
        if not credentials.anchors:
            raise _Unverifiable(
                "signature-protected, but the entry has no tls_ca",
                f"answered {sent} signature-protected, but PKI entry {credentials.entry_id} has no tls_ca to verify "
                "the signer: set tls_ca to the CA certificates of the CMP server's signing certificate",
            )
        try:
            candidates = messages.extra_certs(response)
        except messages.MalformedMessage as error:
            raise _Unverifiable(
                "unreadable extraCerts", f"answered {sent} with unreadable extraCerts ({error})"
            ) from None
        signer = self._signer(response, candidates)
        if signer is None:
            raise _Unverifiable(
                "no signer certificate",
                f"answered {sent} signature-protected without its signer certificate in extraCerts",
            )
        try:
            if not protection.may_sign(signer):
                raise protection.ProtectionFailure("the signer's key usage does not allow digitalSignature")
            protection.verified_signer_chain(signer, candidates, list(credentials.anchors))
            protection.verify_signature(signer.public_key(), algorithm, data, signature)
        except protection.ProtectionFailure as failure:
            raise _Unverifiable(
                f"its signature does not verify against tls_ca: {failure}",
                f"the signature of the answer to {sent} does not verify against tls_ca of PKI entry "
                f"{credentials.entry_id}: {failure}",
            ) from None

    @staticmethod
    def _signer(response: rfc9480.PKIMessage, candidates: list[x509.Certificate]) -> x509.Certificate | None:
        """The protecting certificate: named by senderKID (its key identifier) or the sender name, else the
        first of extraCerts as RFC 9483 §3.3 requires."""
        header = response["header"]
        sender_kid = messages.octets(header["senderKID"])
        sender = messages.name_der(header["sender"])
        for certificate in candidates:
            if sender_kid is not None and protection.key_identifier(certificate) == sender_kid:
                return certificate
        for certificate in candidates:
            if sender and certificate.subject.public_bytes() == sender:
                return certificate
        return candidates[0] if candidates else None



class _Unverifiable(Exception):
    """A response whose protection certlm cannot verify: ``reason`` in a few words, ``message`` the whole story."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
