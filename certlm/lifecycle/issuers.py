"""The issuers of fleet campaigns as trust lists see them: a change of a trust list (``TrustChange``), an issuer's
chain and CRLs (``Issuer``), and what every push keeps trusted while a campaign has the device
(``trust_kept_by_campaigns``). Kept apart from the campaigns' engine (``certlm.lifecycle.campaigns``) because the
push, which the engine uses, needs the last of these."""

from __future__ import annotations

import base64
import contextlib
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field, fields

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from tortoise import connections

from certlm.contracts.drivers import TrustList
from certlm.foundation.certs import issued_by
from certlm.storage.models import Campaign, CampaignDevice, InventoryEntry
from certlm.storage.sql import in_dialect

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

    def with_crls_from(self, crls_der: Iterable[bytes]) -> Issuer:
        """This issuer with the CRLs of ``crls_der`` that a CA of its chain signed (what does not parse is left out)."""
        chain_der = [ca.public_bytes(serialization.Encoding.DER) for ca in self.chain]
        known = {crl.public_bytes(serialization.Encoding.DER) for crl in self.crls}
        added = []
        for der in dict.fromkeys(crls_der):
            if der not in known and _signed_by_any(der, chain_der):
                added.append(x509.load_der_x509_crl(der))
        return Issuer(self.chain, (*self.crls, *added)) if added else self

    def without(self, shared: Iterable[x509.Certificate]) -> Issuer:
        """This issuer without the CAs of ``shared`` and the CRLs they signed."""
        shared_der = {ca.public_bytes(serialization.Encoding.DER) for ca in shared}
        if not shared_der:
            return self
        kept = tuple(ca for ca in self.chain if ca.public_bytes(serialization.Encoding.DER) not in shared_der)
        dropped = [ca.public_bytes(serialization.Encoding.DER) for ca in self.chain if ca not in kept]
        crls = tuple(
            crl for crl in self.crls if not _signed_by_any(crl.public_bytes(serialization.Encoding.DER), dropped)
        )
        return Issuer(kept, crls)

    def change(self, *, removed: bool = False) -> TrustChange:
        return TrustChange.of_issuer(self.chain, self.crls, removed=removed)


def _load_pem_crls(text: str) -> Iterable[x509.CertificateRevocationList]:
    marker = "-----END X509 CRL-----"
    for block in text.split(marker):
        if "-----BEGIN X509 CRL-----" in block:
            yield x509.load_pem_x509_crl((block.strip() + "\n" + marker + "\n").encode())


def old_issuer(campaign: Campaign) -> Issuer:
    """What the campaign retires: the old chain and its CRLs without the CAs the new chain shares. A new issuing CA
    under the same root (an EST server's new intermediate) shares the root: retiring it would take from every device
    the root both chains need, and with it the root's CRLs."""
    old = Issuer.from_pem(campaign.old_issuer_pem, campaign.old_crls_pem)
    return old.without(new_issuer(campaign).chain)


def new_issuer(campaign: Campaign) -> Issuer:
    return Issuer.from_pem(campaign.new_issuer_pem, campaign.new_crls_pem)


# --- what every push keeps trusted ----------------------------------------------------------------------------------


async def trust_kept_by_campaigns(entry_id: int, *, kept: bool | None = None) -> TrustList:
    """What a push to the device must keep trusted beside its PKI's chain: both issuers of every campaign that has
    the device and has not retired the old issuer on it (``PushRequest.also_trusted``). ``kept``: whether such a
    campaign has the device, as the caller read it already (``keeping_campaign_test``); None: asked here.

    The old issuer's CRLs are those the campaign was given (its PKI's ``crl()``) and those of its CAs the device's
    trust list holds as certlm last read or wrote it (``InventoryEntry.trustlist``). The backend gives at most one
    CRL, and none for a CA whose certificates name no distribution point (CMP); an issuing CA's own CRL comes only
    from the certificates it issued. Without them a reissue push would drop the old CA's CRL, and a device that demands
    a CRL of every CA on a path would refuse the peers that still present old certificates until the retire."""
    if kept is None:
        database = connections.get("default")
        sql = _keeping_campaign_sql(database.capabilities.dialect)
        kept = bool(await database.execute_query_dict(sql, keeping_campaign_values(entry_id)))
    if not kept:
        return TrustList()  # the usual push: no campaign has the device
    rows = await CampaignDevice.filter(
        entry_id=entry_id, campaign__state__in=KEEPING_STATES, retire__not=STEP_DONE
    ).prefetch_related("campaign")
    rows = [row for row in rows if row.campaign.kind != REKEY]
    if not rows:
        return TrustList()
    held_crls = await _stored_crls(entry_id)
    kept_trust = TrustList()
    for row in rows:
        for issuer in (old_issuer(row.campaign).with_crls_from(held_crls), new_issuer(row.campaign)):
            kept_trust = issuer.change().applied_to(kept_trust)
    return kept_trust


def keeping_campaign_test() -> str:
    """A SELECT that answers a row when a campaign that keeps trust has the device (``{}`` for each of
    ``keeping_campaign_values``): for a statement that asks it beside other reads (``EXISTS``)."""
    states = ", ".join("{}" for _ in KEEPING_STATES)
    return (
        "SELECT 1 FROM campaign_device d JOIN campaign c ON c.id = d.campaign_id "
        f"WHERE d.entry_id = {{}} AND c.state IN ({states}) AND (d.retire IS NULL OR d.retire <> {{}})"
    )


def keeping_campaign_values(entry_id: int) -> list[object]:
    return [entry_id, *KEEPING_STATES, STEP_DONE]


@functools.cache
def _keeping_campaign_sql(dialect: str) -> str:
    """Whether a campaign that keeps trust has the device: plain SQL built once, as every push asks."""
    return in_dialect(f"{keeping_campaign_test()} LIMIT 1", dialect)


async def _stored_crls(entry_id: int) -> list[bytes]:
    """The CRLs (DER) of the device's trust list as certlm last stored it, trusted and issuer lists."""
    stored = await InventoryEntry.filter(id=entry_id).values_list("trustlist", flat=True)
    record = stored[0] if stored and isinstance(stored[0], dict) else {}
    crls = []
    for key in ("trustlist_trusted_crl", "trustlist_issuer_crl"):
        for item in record.get(key) or ():
            with contextlib.suppress(ValueError, TypeError):
                crls.append(base64.b64decode(item, validate=True))
    return crls


def _unique(items: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(items))
