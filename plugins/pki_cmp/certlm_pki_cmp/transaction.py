"""One CMP transaction (RFC 9483 §3): the requests of one transactionID, each protected, each response checked
(transactionID, recipNonce, MAC or signature) before certlm believes a word of it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cryptography import x509
from pyasn1_alt_modules import rfc9480

from certlm.errors import APIError, CsrRejected, UpstreamUnavailable
from certlm.pki_client import ClientCredential
from certlm_pki_cmp import messages, protection
from certlm_pki_cmp.messages import Status
from certlm_pki_cmp.transport import CmpTransport

log = logging.getLogger(__name__)

# failInfo bits saying the server did not accept how the request was protected (RFC 9483 §3.6.4).
CREDENTIAL_FAILURES = frozenset({"badMessageCheck", "wrongIntegrity", "signerNotTrusted"})
# failInfo bits saying the server itself is not working.
SERVER_FAILURES = frozenset({"systemUnavail", "systemFailure"})


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
    signer: ClientCredential | None
    anchors: tuple[x509.Certificate, ...]

    @property
    def signs(self) -> bool:
        return self.signer is not None


class ServerRefused(Exception):
    """The server answered with an error message or a negative status: ``status`` says why. ``verified`` is
    False for an unprotected error message, which anyone on the path could have sent."""

    def __init__(self, status: Status, *, verified: bool = True) -> None:
        super().__init__(status.describe())
        self.status = status
        self.verified = verified

    def as_api_error(self, entry_id: int, refused: str, rejected: type[APIError] = CsrRejected) -> APIError:
        """The error a client of certlm sees: credentials or server trouble as 502, a refusal as ``rejected``."""
        detail = self.status.describe() + ("" if self.verified else " (unprotected answer)")
        failures = set(self.status.failures)
        if failures & CREDENTIAL_FAILURES:
            return UpstreamUnavailable(
                f"CMP server did not accept the credentials of PKI entry {entry_id}: {detail}; check username and "
                "password or the client PKCS#12"
            )
        if failures & SERVER_FAILURES:
            return UpstreamUnavailable(f"CMP server of PKI entry {entry_id} is not available: {detail}")
        return rejected(f"CMP server {refused}: {detail}")


class Transaction:
    """Requests and responses sharing one transactionID, the nonces chained from each response to the next
    request. A PBMAC1-protected response switches the rest of the transaction to PBMAC1 (RFC 9481 §6.1.2)."""

    def __init__(self, transport: CmpTransport, credentials: Credentials, recipient: x509.Name | None = None) -> None:
        self.transport = transport
        self.credentials = credentials
        self.recipient = recipient
        self.transaction_id = messages.nonce()
        self._recip_nonce: bytes | None = None
        self._pbmac1 = False

    def _unavailable(self, problem: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(f"CMP server of PKI entry {self.credentials.entry_id}: {problem}")

    def _protect(self, body: rfc9480.PKIBody, sender_nonce: bytes, implicit_confirm: bool) -> bytes:
        credentials = self.credentials
        if credentials.signer is not None:
            algorithm = protection.signature_algorithm(credentials.signer.private_key)
            sender = credentials.signer.certificate.subject
            sender_kid = protection.key_identifier(credentials.signer.certificate)
        else:
            algorithm = protection.pbmac1_algorithm() if self._pbmac1 else protection.password_based_mac_algorithm()
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
        """Send ``body`` and return the verified response; ``ServerRefused`` for an error message."""
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
        verified = self._verify(response, sent)
        self._recip_nonce = messages.octets(header["senderNonce"])
        if received == "error":
            raise ServerRefused(messages.error_status(response), verified=verified)
        if not verified:
            raise self._unavailable(f"answered {sent} with an unprotected {received}; certlm accepts none")
        return response

    def _verify(self, response: rfc9480.PKIMessage, sent: str) -> bool:
        """Whether the response is protected and verifies; an unprotected error message returns False."""
        algorithm = response["header"]["protectionAlg"]
        signature = messages.protection_bytes(response)
        if not algorithm.isValue or signature is None:
            if messages.body_type(response) == "error":
                return False
            raise self._unavailable(f"answered {sent} without protection")
        data = messages.protected_part(response)
        credentials = self.credentials
        if protection.is_mac(algorithm):
            if credentials.secret is None:
                raise self._unavailable(
                    f"answered {sent} MAC-protected, but PKI entry {credentials.entry_id} has no password to verify it"
                )
            try:
                protection.verify_mac(credentials.secret, algorithm, data, signature)
            except protection.ProtectionFailure as failure:
                raise self._unavailable(
                    f"the answer to {sent} does not verify with the password of PKI entry {credentials.entry_id} "
                    f"({failure}): the server did not accept the credentials (check username and password) or "
                    f"the answer was altered{self._unverified_text(response)}"
                ) from None
            self._pbmac1 = self._pbmac1 or protection.is_pbmac1(algorithm)
            return True
        self._verify_signature(response, sent, algorithm, data, signature)
        return True

    def _verify_signature(self, response, sent: str, algorithm, data: bytes, signature: bytes) -> None:
        credentials = self.credentials
        if not credentials.anchors:
            raise self._unavailable(
                f"answered {sent} signature-protected, but PKI entry {credentials.entry_id} has no tls_ca to verify "
                "the signer: set tls_ca to the CA certificates of the CMP server's signing certificate"
            )
        try:
            candidates = messages.extra_certs(response)
        except messages.MalformedMessage as error:
            raise self._unavailable(f"answered {sent} with unreadable extraCerts ({error})") from None
        signer = self._signer(response, candidates)
        if signer is None:
            raise self._unavailable(f"answered {sent} signature-protected without its signer certificate in extraCerts")
        try:
            if not protection.may_sign(signer):
                raise protection.ProtectionFailure("the signer's key usage does not allow digitalSignature")
            protection.verified_signer_chain(signer, candidates, list(credentials.anchors))
            protection.verify_signature(signer.public_key(), algorithm, data, signature)
        except protection.ProtectionFailure as failure:
            raise self._unavailable(
                f"the signature of the answer to {sent} does not verify against tls_ca of PKI entry "
                f"{credentials.entry_id}: {failure}{self._unverified_text(response)}"
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

    @staticmethod
    def _unverified_text(response: rfc9480.PKIMessage) -> str:
        if messages.body_type(response) != "error":
            return ""
        return f" (the server said, unverified: {messages.error_status(response).describe()})"
