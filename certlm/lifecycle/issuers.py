"""The issuers of fleet campaigns as trust lists see them: a change of a trust list (``TrustChange``), an issuer's
chain and CRLs (``Issuer``), and what every push keeps trusted while a campaign has the device
(``trust_kept_by_campaigns``). Kept apart from the campaigns' engine (``certlm.lifecycle.campaigns``) because the
push, which the engine uses, needs the last of these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.contracts.drivers import TrustList
from certlm.foundation.certs import issued_by
from certlm.storage.models import Campaign, CampaignDevice

TRUST_LIST_PARTS = tuple(part.name for part in fields(TrustList))
CA_ROLLOVER, PKI_MIGRATION, REKEY = "ca-rollover", "pki-migration", "rekey"
RUNNING, PAUSED, CANCELLED, FINISHED = "running", "paused", "cancelled", "finished"
# Campaigns whose additions stay in trust lists: a cancelled one too (cancel leaves every device working).
KEEPING_STATES = (RUNNING, PAUSED, CANCELLED)
# A device's state in one phase.
PENDING, STEP_DONE, FAILED, UNVERIFIED = "pending", "done", "failed", "unverified"
EXCEPTED, SKIPPED = "excepted", "skipped"


@dataclass(frozen=True)
class TrustChange:
    """DER certificates and CRLs to add to (``add``) and to remove from (``remove``) a trust list, part by part."""

    add: TrustList = field(default_factory=TrustList)
    remove: TrustList = field(default_factory=TrustList)

    @classmethod
    def of_issuer(
        cls,
        chain: Iterable[x509.Certificate],
        crls: Iterable[x509.CertificateRevocationList] = (),
        *,
        removed: bool = False,
    ) -> TrustChange:
        """An issuer's CA chain and CRLs, added to (or, ``removed``, taken from) the trusted lists, where a push puts
        a PKI's chain and CRLs."""
        issuer = TrustList(
            trusted_certificates=_unique(ca.public_bytes(serialization.Encoding.DER) for ca in chain),
            trusted_crls=_unique(crl.public_bytes(serialization.Encoding.DER) for crl in crls),
        )
        return cls(remove=issuer) if removed else cls(add=issuer)

    def applied_to(self, current: TrustList) -> TrustList:
        """``current`` with what is removed left out and what is added appended (each once), the rest in its order.
        A removed CA takes every CRL it signed with it, not only the ones named: a CA re-signs its CRL as it goes, and
        a device refuses a list that keeps a CRL whose issuer is gone."""
        parts = {}
        for part in TRUST_LIST_PARTS:
            removed = self._removed(part, current)
            kept = [item for item in getattr(current, part) if item not in removed]
            parts[part] = _unique([*kept, *getattr(self.add, part)])
        return TrustList(**parts)

    def held_by(self, trust_list: TrustList) -> bool:
        """Whether ``trust_list`` holds everything added and nothing removed (a removed CA's CRLs included)."""
        for part in TRUST_LIST_PARTS:
            held = set(getattr(trust_list, part))
            if not set(getattr(self.add, part)) <= held or held & self._removed(part, trust_list):
                return False
        return True

    def _removed(self, part: str, current: TrustList) -> set[bytes]:
        removed = set(getattr(self.remove, part))
        if part in ("trusted_crls", "issuer_crls"):
            cas = [*self.remove.trusted_certificates, *self.remove.issuer_certificates]
            if cas:
                removed |= {crl for crl in getattr(current, part) if _signed_by_any(crl, cas)}
        return removed

    @property
    def empty(self) -> bool:
        return not any(getattr(self.add, part) or getattr(self.remove, part) for part in TRUST_LIST_PARTS)


def _signed_by_any(crl_der: bytes, cas_der: list[bytes]) -> bool:
    """Whether the CRL (DER) was signed by one of the CAs (DER); False for what does not parse."""
    try:
        crl = x509.load_der_x509_crl(crl_der)
    except ValueError:
        return False
    for ca_der in cas_der:
        try:
            ca = x509.load_der_x509_certificate(ca_der)
        except ValueError:
            continue
        if crl.issuer == ca.subject and crl.is_signature_valid(ca.public_key()):  # type: ignore[arg-type]
            return True
    return False


@dataclass(frozen=True)
class Issuer:
    """An issuer's CA chain and CRLs, as a campaign keeps them (PEM)."""

    chain: tuple[x509.Certificate, ...]
    crls: tuple[x509.CertificateRevocationList, ...]

    @classmethod
    def from_pem(cls, chain_pem: str, crls_pem: str) -> Issuer:
        chain = tuple(x509.load_pem_x509_certificates(chain_pem.encode())) if chain_pem.strip() else ()
        crls = tuple(_load_pem_crls(crls_pem))
        return cls(chain, crls)

    def chain_pem(self) -> str:
        return "".join(ca.public_bytes(serialization.Encoding.PEM).decode() for ca in self.chain)

    def crls_pem(self) -> str:
        return "".join(crl.public_bytes(serialization.Encoding.PEM).decode() for crl in self.crls)

    def issued(self, certificate: x509.Certificate) -> bool:
        return any(issued_by(certificate, ca) for ca in self.chain)

    def change(self, *, removed: bool = False) -> TrustChange:
        return TrustChange.of_issuer(self.chain, self.crls, removed=removed)


def _load_pem_crls(text: str) -> Iterable[x509.CertificateRevocationList]:
    marker = "-----END X509 CRL-----"
    for block in text.split(marker):
        if "-----BEGIN X509 CRL-----" in block:
            yield x509.load_pem_x509_crl((block.strip() + "\n" + marker + "\n").encode())


def old_issuer(campaign: Campaign) -> Issuer:
    return Issuer.from_pem(campaign.old_issuer_pem, campaign.old_crls_pem)


def new_issuer(campaign: Campaign) -> Issuer:
    return Issuer.from_pem(campaign.new_issuer_pem, campaign.new_crls_pem)


# --- what every push keeps trusted ----------------------------------------------------------------------------------


async def trust_kept_by_campaigns(entry_id: int) -> TrustList:
    """What a push to the device must keep trusted beside its PKI's chain: both issuers of every campaign that has
    the device and has not retired the old issuer on it (``PushRequest.also_trusted``)."""
    rows = await CampaignDevice.filter(
        entry_id=entry_id, campaign__state__in=KEEPING_STATES, retire__not=STEP_DONE
    ).prefetch_related("campaign")
    kept = TrustList()
    for row in rows:
        if row.campaign.kind == REKEY:
            continue
        for issuer in (old_issuer(row.campaign), new_issuer(row.campaign)):
            kept = issuer.change().applied_to(kept)
    return kept


def _unique(items: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(items))
