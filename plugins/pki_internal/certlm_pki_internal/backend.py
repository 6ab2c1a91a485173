"""PKI type 1, ``internal``: a root CA per PKI entry, kept in the database with its key encrypted at rest."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from functools import partial

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from tortoise.exceptions import IntegrityError
from tortoise.transactions import in_transaction

from certlm import (
    APIError,
    Enrollment,
    EnrollmentRequest,
    HostServices,
    PkiBackend,
    PkiEntry,
    SuccessorIssuer,
    forget_read,
    read_once,
    rows_of,
    serial_hex,
    stored_certificate,
    stored_crl,
)
from certlm_pki_internal import ca
from certlm_pki_internal.models import InternalCa, IssuedCertificate

# The setting (``Settings.extra`` key) for the lifetime of issued certificates, in days.
VALIDITY_SETTING = "pki_internal_validity_days"
# A served CRL is re-signed after a day, so relying parties always get one valid for six more days at least.
CRL_REFRESH_AFTER = timedelta(days=1)


async def _stored_authority(entry: PkiEntry) -> InternalCa | None:
    # Plain SQL built once: every push reads the row.
    found = await rows_of(InternalCa, '"pki_entry_id" = {}', entry.id)
    return found[0] if found else None


# A CRL up to this size (some 300 revocations) is parsed on the event loop: in well under 0.1 ms, and each distinct CRL
# once (``stored_crl``; a push's is parsed already), where a round trip to a thread costs some 0.06 ms of CPU and
# 0.1 ms of waiting. A larger one is parsed in a thread.
INLINE_CRL_BYTES = 8 * 1024


async def _parsed_crl(der: bytes) -> x509.CertificateRevocationList:
    return stored_crl(der) if len(der) <= INLINE_CRL_BYTES else await asyncio.to_thread(stored_crl, der)


def _row_key(entry: PkiEntry) -> tuple[str, int]:
    """The key the entry's CA row is read once under (``read_once``)."""
    return ("pki_internal_ca", entry.id)


class InternalPki(PkiBackend):
    pki_type = 1
    name = "internal"
    crl_is_local = True

    def __init__(self, services: HostServices) -> None:
        super().__init__(services)
        raw = services.settings.extra.get(VALIDITY_SETTING, ca.DEFAULT_LEAF_VALIDITY_DAYS)
        text = str(raw)
        if isinstance(raw, bool) or not (text.isascii() and text.isdigit() and len(text) <= 5 and int(text) >= 1):
            raise ValueError(f"{VALIDITY_SETTING} must be a whole number of days from 1, got {raw!r}")
        validity_days = int(text)
        self._validity = timedelta(days=validity_days)
        # Serialises root creation and CRL numbering within this process; the database's unique key and row
        # lock do the same across instances sharing a PostgreSQL database.
        self._lock = asyncio.Lock()

    def _policy(self, entry: PkiEntry) -> ca.IssuancePolicy:
        public_url = self.services.settings.public_url
        if not public_url:
            return ca.IssuancePolicy(validity=self._validity)
        base = public_url.rstrip("/")
        # RFC 5280 §4.2.1.13 and §4.2.2.1: HTTP URIs in these extensions must deliver DER.
        return ca.IssuancePolicy(
            validity=self._validity,
            crl_url=f"{base}/pki/crl/{entry.id}?format=der",
            ca_issuers_url=f"{base}/pki/ca/{entry.id}?format=der",
        )

    async def _authority(self, entry: PkiEntry, like: x509.Certificate | None = None) -> InternalCa:
        """The entry's root CA, created on first use (with a key of the kind of ``like``'s when given). Read once per
        request or push (its chain, its CRL and the signing each ask)."""
        authority = await read_once(_row_key(entry), partial(_stored_authority, entry))
        if authority is not None:
            return authority
        forget_read(_row_key(entry))
        async with self._lock:
            authority = await InternalCa.get_or_none(pki_entry_id=entry.id)
            if authority is not None:
                return authority
            key, certificate = await asyncio.to_thread(self._new_root, entry.id, like)
            key_der = key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            try:
                return await InternalCa.create(
                    pki_entry_id=entry.id,
                    certificate_pem=certificate.public_bytes(serialization.Encoding.PEM).decode(),
                    private_key_enc=self.services.secrets.encrypt(key_der),
                )
            except IntegrityError:
                # Another instance on the same database created the root first: everyone uses that one.
                return await InternalCa.get(pki_entry_id=entry.id)

    @staticmethod
    def _new_root(pki_id: int, like: x509.Certificate | None = None) -> tuple[ca.RootKey, x509.Certificate]:
        key = ca.generate_root_key() if like is None else ca.generate_key_like(like)
        return key, ca.create_root(key, pki_id, datetime.now(UTC))

    async def successor_issuer(self, entry: PkiEntry) -> SuccessorIssuer:
        """A new internal CA to follow ``entry``'s: a new PKI entry with the entry's settings, named as its successor,
        and a new root with a new key of the same kind and size (``ca.generate_key_like``) and the configured
        validity. Each call makes another one: a campaign asks once per rollover, and refuses a second rollover of
        devices already in one before it asks. No cross-certificate is issued: a device trusts the new root itself
        from the campaign's trust phase on, before any certificate of it is presented, so a path through the old
        root would serve no device."""
        predecessor = (await self.ca_certificates(entry))[0]
        name = f"Successor of {entry.name or 'internal CA'} (PKI entry {entry.id})"
        successor = await PkiEntry.create(
            name=name[:255],
            pki_type=entry.pki_type,
            pki_connection=entry.pki_connection,
            additional_path_segment=entry.additional_path_segment,
            require_requested_names=entry.require_requested_names,
            allow_certlm_generated_keys=entry.allow_certlm_generated_keys,
            creator_id=entry.creator_id,
        )
        authority = await self._authority(successor, like=predecessor)
        root = stored_certificate(authority.certificate_pem)
        crl = await self.crl(successor)
        how = (
            f"certlm made a new internal CA, PKI entry {successor.id} ({name}): {root.subject.rfc4514_string()}, a new "
            f"{ca.describe_key(root)} key, valid until {root.not_valid_after_utc.date().isoformat()}"
        )
        return SuccessorIssuer(pki_id=successor.id, chain=(root,), crls=(crl,), how=how)

    def _signing_material(self, authority: InternalCa) -> tuple[x509.Certificate, ca.RootKey]:
        # The stored key is one this backend generated, and SecretBox's authenticated encryption proves it unchanged:
        # OpenSSL's RSA consistency check (some 90 ms for RSA-3072, on every signature) would prove nothing more.
        key = serialization.load_der_private_key(
            self.services.secrets.decrypt(authority.private_key_enc), None, unsafe_skip_rsa_key_validation=True
        )
        if not isinstance(key, rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey):
            raise APIError(f"internal CA {authority.id} has a stored key that is neither RSA nor EC", 500)
        return stored_certificate(authority.certificate_pem), key

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        authority = await self._authority(entry)
        return [stored_certificate(authority.certificate_pem)]

    async def published_ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        # The CA lives in certlm's own database: serving it contacts nothing.
        return await self.ca_certificates(entry)

    async def issue(self, entry: PkiEntry, request: EnrollmentRequest) -> Enrollment:
        # A renewal is an enrollment like any other here: the CSR's own signature is the proof of possession
        # and the CA's policy does not depend on the old certificate.
        authority = await self._authority(entry)
        policy = self._policy(entry)

        def sign() -> tuple[x509.Certificate, x509.Certificate]:
            # Loading the key and the RSA signature take milliseconds each: off the event loop, which serves
            # every other request meanwhile (OpenSSL releases the GIL while it signs).
            ca_certificate, ca_key = self._signing_material(authority)
            issued = ca.issue(request.csr, request.profile, ca_certificate, ca_key, policy, datetime.now(UTC))
            return issued, ca_certificate

        certificate, ca_certificate = await asyncio.to_thread(sign)
        await IssuedCertificate.create(
            ca_id=authority.id,
            serial_number=serial_hex(certificate),
            subject_dn=certificate.subject.rfc4514_string(),
            profile=request.profile.name,
            not_valid_after=certificate.not_valid_after_utc,
        )
        return Enrollment(certificate=certificate, chain=(ca_certificate,))

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        authority = await self._authority(entry)
        # A CRL of many revocations takes long to parse, and longer to sign: both run off the event loop.
        if self._is_fresh(authority, datetime.now(UTC)):
            return await _parsed_crl(authority.crl_der)
        # The row read once stays as read: re-signing the CRL changes none of the columns signing uses, and a later
        # call in the same request or push that finds the CRL stale comes here, where the row is read again locked.
        async with self._lock, in_transaction() as connection:
            authority = await InternalCa.filter(id=authority.id).using_db(connection).select_for_update().get()
            now = datetime.now(UTC)
            if self._is_fresh(authority, now):
                return await _parsed_crl(authority.crl_der)
            # Expired certificates fail validation anyway; RFC 5280 §3.3 lets them leave the CRL.
            revoked = await IssuedCertificate.filter(
                ca_id=authority.id, revoked_at__isnull=False, not_valid_after__gt=now
            ).using_db(connection)
            revocations = [
                ca.Revocation(
                    serial_number=int(record.serial_number, 16),
                    revoked_at=record.revoked_at,
                    reason=x509.ReasonFlags(record.revocation_reason),
                )
                for record in revoked
            ]

            def sign() -> tuple[x509.CertificateRevocationList, bytes]:
                ca_certificate, ca_key = self._signing_material(authority)
                signed = ca.build_crl(ca_certificate, ca_key, revocations, authority.next_crl_number, now)
                return signed, signed.public_bytes(serialization.Encoding.DER)

            crl, authority.crl_der = await asyncio.to_thread(sign)
            authority.next_crl_number += 1
            authority.crl_last_update = now
            await authority.save(using_db=connection)
            return crl

    @staticmethod
    def _is_fresh(authority: InternalCa, now: datetime) -> bool:
        return (
            authority.crl_der is not None
            and authority.crl_last_update is not None
            and now - authority.crl_last_update < CRL_REFRESH_AFTER
        )

    async def revoke(self, entry: PkiEntry, certificate: x509.Certificate, reason: x509.ReasonFlags) -> None:
        authority = await self._authority(entry)
        ca_certificate = stored_certificate(authority.certificate_pem)
        try:
            certificate.verify_directly_issued_by(ca_certificate)
        except (ValueError, TypeError, InvalidSignature):
            raise APIError(
                f"certificate {certificate.subject.rfc4514_string()} was not issued by the internal CA "
                f"of PKI entry {entry.id}"
            ) from None
        if reason == x509.ReasonFlags.remove_from_crl:
            raise APIError("removeFromCRL belongs in delta CRLs, which the internal CA does not publish")
        record, _ = await IssuedCertificate.get_or_create(
            ca_id=authority.id,
            serial_number=serial_hex(certificate),
            defaults={
                "subject_dn": certificate.subject.rfc4514_string(),
                "profile": "unknown",
                "not_valid_after": certificate.not_valid_after_utc,
            },
        )
        if record.revoked_at is not None and record.revocation_reason == reason.value:
            return
        # A changed reason (say certificateHold becoming keyCompromise) keeps the original revocation date.
        record.revoked_at = record.revoked_at or datetime.now(UTC)
        record.revocation_reason = reason.value
        await record.save(update_fields=["revoked_at", "revocation_reason"])
        await InternalCa.filter(id=authority.id).update(crl_der=None, crl_last_update=None)
        forget_read(_row_key(entry))
