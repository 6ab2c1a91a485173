"""certlm's own client certificates across a campaign that retires their issuer.

certlm logs in to devices with client certificates of its own (the OPC UA client application of GDS push; a vendor
plugin's: ``certlm_provide_client_certificates``). One issued by the CA a campaign retires would be refused by every
device once the retire phase took that CA out of its trust list: certlm would lock itself out, and the GDS driver
refuses to write such a list, so the campaign would never finish. Before the retire phase begins, each such
certificate is renewed from the campaign's new issuer (its PKI entry ``to_pki_id``, client profile) as soon as every
device in scope trusts that issuer, when the trust phase is through, and the campaign goes on once every instance
presents the new certificate. That is before the reissue phase, so its pushes keep certlm trusted through the new
issuer (a push by a certificate of the old one would add that certificate itself to every trust list, the only way
it could stay in after the retire phase); it is checked again before the retire phase. A self-signed certificate,
or one of another CA, is left alone: retiring the old CA does not touch what devices trust it by.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from cryptography import x509

from certlm.contracts.enrollment import CLIENT_PROFILE, Enrollment
from certlm.contracts.services import ClientCertificateIssuer
from certlm.foundation.certs import sha1_fingerprint
from certlm.foundation.errors import APIError
from certlm.lifecycle.issuers import new_issuer, old_issuer
from certlm.lifecycle.runtime import Runtime
from certlm.storage.models import Campaign, PkiEntry

log = logging.getLogger(__name__)


async def client_certificates_off_old_issuer(runtime: Runtime, campaign: Campaign) -> str | None:
    """Renew every client certificate of certlm's that the campaign's old issuer signed from its new issuer; None
    once none is left and every instance presents the renewed ones, else what the campaign waits for, in a sentence
    (its ``blocked``). A failed renewal leaves the stored certificate as it was, so the next
    round tries again."""
    old, new = old_issuer(campaign), new_issuer(campaign)
    waiting = []
    for holder in runtime.client_certificates:
        try:
            presented = await holder.presented()
            if presented is None or not old.issued(presented.certificate):
                continue
            replacing = presented.certificate
            log.info("campaign %d: certlm's %s (%s) was issued by the issuer the campaign retires: renewing it from "
                     "PKI entry %d", campaign.id, holder.description, certificate_name(replacing),
                     campaign.to_pki_id)  # fmt: skip
            presented = await holder.renew(await _issuer(runtime, campaign), replacing)
        except Exception as error:  # a plugin's holder may fail in its own ways: named, and tried again next round
            reason = error.message if isinstance(error, APIError) else f"{type(error).__name__}: {error}"
            log.warning("campaign %d: renewing certlm's %s failed: %s", campaign.id, holder.description, reason)
            waiting.append(
                f"certlm's {holder.description} is issued by the old issuer and could not be renewed from PKI entry "
                f"{campaign.to_pki_id}: {reason}"
            )
            continue
        if not new.issued(presented.certificate):
            waiting.append(
                f"certlm's {holder.description} was renewed, but {certificate_name(presented.certificate)} is not "
                f"issued by the campaign's new issuer, which is all the devices will trust"
            )
        elif presented.everywhere_from > datetime.now(UTC):
            waiting.append(
                f"certlm's {holder.description} was renewed from the new issuer; every certlm instance presents it "
                f"from {presented.everywhere_from.isoformat(timespec='seconds')}"
            )
    if not waiting:
        return None
    return (
        f"the {campaign.phase} phase is through, but no device may stop trusting the old issuer while certlm "
        f"presents a certificate of it: " + "; ".join(waiting)
    )


async def _issuer(runtime: Runtime, campaign: Campaign) -> ClientCertificateIssuer:
    """Signs a client CSR with the campaign's new issuer (its PKI entry, client profile)."""
    pki = await PkiEntry.get_or_none(id=campaign.to_pki_id)
    if pki is None or not runtime.pki_backends.known(pki.pki_type):
        raise APIError(f"PKI entry {campaign.to_pki_id} is gone or its backend is not installed")
    backend = runtime.pki_backends.get(pki.pki_type)

    async def issue(csr: x509.CertificateSigningRequest) -> Enrollment:
        return await backend.enroll(pki, csr, CLIENT_PROFILE)

    return issue


def certificate_name(certificate: x509.Certificate) -> str:
    return f"{certificate.subject.rfc4514_string()} (SHA-1 {sha1_fingerprint(certificate)})"
