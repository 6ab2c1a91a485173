"""Approving a client certificate a device rejected: the certificate itself, or the CA that issued it, is added to
the device's trust list through its driver (``certlm.lifecycle.trust.change_trust_list``: read, changed, written
only when it differs, read back), and the record says who approved what, when, and whether the device's list was
read back holding it (``verified``)."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.contracts.drivers import TrustList
from certlm.foundation.certs import crl_signed_by, is_self_signed, issued_by, issuer_chain
from certlm.lifecycle.issuers import TrustChange
from certlm.lifecycle.monitoring import reading
from certlm.lifecycle.rejected import APPROVED, DecisionConflict, decide, decided_already, fingerprint
from certlm.lifecycle.runtime import Runtime
from certlm.lifecycle.trust import change_trust_list
from certlm.storage.models import InventoryEntry, PkiEntry, RejectedClient

TRUST_CERTIFICATE, TRUST_ISSUER = "certificate", "issuer"


def _der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


async def approve(runtime: Runtime, record: RejectedClient, trust: str) -> RejectedClient:
    """Add the record's certificate (``trust`` ``certificate``) or its issuing CA (``issuer``) to its device's trust
    list and mark it approved. 409 (``DecisionConflict``) when it was approved already, its device was deleted, or the
    issuer's certificate is nowhere to be had; what the driver raises otherwise (502, 501), the record unchanged."""
    if record.state == APPROVED:
        raise decided_already(record)
    entry = await InventoryEntry.get_or_none(id=record.entry_id)
    if entry is None:
        raise DecisionConflict(
            f"the device {record.device} (inventory entry {record.entry_id}) that rejected this certificate was "
            "deleted since: nothing was changed"
        )
    # The write and the decision under one hold of the device's lease (re-entrant: change_trust_list takes it too),
    # the record read again once it is held: of two operators approving the same certificate at once, on any
    # instances, the one that waited for the lease finds it approved and gets 409 without touching the device, and
    # the record names the one whose write it was.
    async with reading(runtime.settings, entry):
        await record.refresh_from_db()
        if record.state == APPROVED:
            raise decided_already(record)
        certificate = x509.load_der_x509_certificate(record.certificate_der)
        if trust == TRUST_CERTIFICATE:
            change, trusted = TrustChange(add=TrustList(trusted_certificates=[record.certificate_der])), certificate
        else:
            change, trusted = await _issuer_change(runtime, record, certificate)
        changed = await change_trust_list(runtime, entry, change, trigger="approve_rejected")
        trusted_now = {
            "trust": trust,
            "certificate": {"subject": trusted.subject.rfc4514_string(), "fingerprint": fingerprint(trusted)},
            "written": changed.written,
            "verified": changed.verified,
        }
        # Still the conditional decision (a row lock on PostgreSQL): a lease taken over from a stalled holder must
        # not let two approvals both win.
        return await decide(record, APPROVED, unless=(APPROVED,), trusted=trusted_now)


async def _issuer_change(
    runtime: Runtime, record: RejectedClient, certificate: x509.Certificate
) -> tuple[TrustChange, x509.Certificate]:
    """The issuing CA as a trusted certificate (with the CAs above it as issuers, and the CRLs certlm holds for
    them), from what the same device rejected beside it (a chain the client sent) or from a PKI entry."""
    if is_self_signed(certificate):
        raise DecisionConflict(
            f"rejected certificate {record.id} is self-signed: it is its own issuer. Approve it with "
            '{"trust": "certificate"}'
        )
    pool, crls = await _known_cas(runtime, record)
    issuer = next((ca for ca in pool if issued_by(certificate, ca)), None)
    if issuer is None:
        raise DecisionConflict(
            f"the certificate of its issuer ({certificate.issuer.rfc4514_string()}) is not available: the device did "
            "not reject it with the client's certificate and no PKI entry holds it. Approve the certificate itself "
            '({"trust": "certificate"}), or add its CA as a PKI entry first; nothing was changed'
        )
    above = issuer_chain(issuer, pool)
    change = TrustChange(
        add=TrustList(
            trusted_certificates=[_der(issuer)],
            trusted_crls=[_der(crl) for crl in crls if crl_signed_by(crl, [issuer])],
            issuer_certificates=[_der(ca) for ca in above],
            issuer_crls=[_der(crl) for crl in crls if above and crl_signed_by(crl, above)],
        )
    )
    return change, issuer


async def _known_cas(
    runtime: Runtime, record: RejectedClient
) -> tuple[list[x509.Certificate], list[x509.CertificateRevocationList]]:
    """CA certificates certlm can vouch for: those the same device rejected (a chain it kept), then every PKI entry's
    chain, with the PKI entries' CRLs."""
    pool: list[x509.Certificate] = []
    crls: list[x509.CertificateRevocationList] = []
    for row in await RejectedClient.filter(entry_id=record.entry_id).exclude(id=record.id):
        pool.append(x509.load_der_x509_certificate(row.certificate_der))
    for pki in await PkiEntry.all().order_by("id"):
        if not runtime.pki_backends.known(pki.pki_type):
            continue
        sources = await runtime.crl_cache.sources(pki, runtime.pki_backends.get(pki.pki_type))
        pool.extend(sources.ca_chain)
        crls.extend(sources.crls or ())
    return [ca for ca in pool if _is_ca(ca)], crls


def _is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False
