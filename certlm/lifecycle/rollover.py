"""The issuers' own end of life. A CA certificate that expires takes every certificate it issued with it: the devices
of its PKI entry stop trusting each other at that moment. ``Settings.ca_rollover_warning_days`` before the first CA
certificate of an entry's chain expires, certlm proposes a rollover campaign (``certlm.lifecycle.campaigns``) for the
entry's devices: in ``GET /systeminfo`` (``ca_rollover_proposals``), ``GET /metrics`` and the dashboard, and the
renewal scheduler logs it, so that nobody learns of it from an outage. A proposal says what to POST: a rollover to
the successor the entry's backend makes or reports (``PkiBackend.successor_issuer``), or, for a backend that does
neither, to a PKI entry the operator makes. A proposal ends with a campaign that moves the
entry's devices elsewhere (running, paused or finished).

Only the CA certificates certlm holds are looked at (``PkiBackend.published_ca_certificates``): watching never sends
a request to a PKI.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from certlm.foundation.errors import APIError
from certlm.inventory.entries import DEVICE_STATUS_ACTIVE
from certlm.lifecycle.issuers import CA_ROLLOVER, FINISHED, PAUSED, PKI_MIGRATION, RUNNING
from certlm.lifecycle.runtime import Runtime
from certlm.storage.models import Campaign, InventoryEntry, PkiEntry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloverProposal:
    """A PKI entry whose CA chain expires within the warning days while devices still depend on it; ``campaign`` is
    what to POST to ``/campaigns`` for it. Without ``to_pki_id`` there, the entry's backend makes the successor (the
    internal CA) or reports the one its PKI announced (EST, CMP); ``successor_made`` is False for a backend that does
    neither, whose successor the operator makes as a PKI entry and names as ``to_pki_id``."""

    pki_id: int
    name: str
    ca_subject: str
    expires: datetime
    days_left: int
    devices: int
    campaign: dict[str, Any] = field(default_factory=dict)
    successor_made: bool = True

    def sentence(self) -> str:
        if self.successor_made:
            post = f"start a campaign to its successor: POST /campaigns {json.dumps(self.campaign)}"
        else:
            post = (
                "make a PKI entry for its successor (its PKI type cannot make one) and start a campaign: POST "
                f'/campaigns {json.dumps(self.campaign)[:-1]}, "to_pki_id": <that entry\'s id>}}'
            )
        return (
            f"the CA certificate {self.ca_subject} of PKI entry {self.pki_id} ({self.name}) expires in "
            f"{self.days_left} day(s), on {self.expires.date().isoformat()}; {self.devices} device(s) depend on it: "
            f"{post}"
        )


async def rollover_proposals(runtime: Runtime, now: datetime) -> list[RolloverProposal]:
    """The PKI entries whose CA chain expires within ``ca_rollover_warning_days`` of ``now``, that active devices are
    enrolled from, and that no campaign moves away from yet."""
    warning_days = runtime.settings.ca_rollover_warning_days
    # A rollover within one entry (to the new CA its EST or CMP server announced) leaves the entry with a new CA of its
    # own: once finished, that one is watched again.
    campaigns = await Campaign.filter(
        kind__in=(CA_ROLLOVER, PKI_MIGRATION), state__in=(RUNNING, PAUSED, FINISHED)
    ).values_list("from_pki_id", "to_pki_id", "state")
    moving_away = {from_id for from_id, to_id, state in campaigns if state != FINISHED or to_id != from_id}
    proposals = []
    for pki in await PkiEntry.all().order_by("id"):
        if pki.id in moving_away or not runtime.pki_backends.known(pki.pki_type):
            continue
        try:
            chain = await runtime.pki_backends.get(pki.pki_type).published_ca_certificates(pki)
        except APIError:  # a backend that holds no CA certificates for this entry
            continue
        if not chain:
            continue
        first = min(chain, key=lambda ca: ca.not_valid_after_utc)
        days_left = (first.not_valid_after_utc - now).days
        if days_left > warning_days:
            continue
        devices = await InventoryEntry.filter(pki_id=pki.id, device_status=DEVICE_STATUS_ACTIVE).count()
        if devices:
            name = pki.name or f"PKI entry {pki.id}"
            expires, subject = first.not_valid_after_utc, first.subject.rfc4514_string()
            proposals.append(
                RolloverProposal(
                    pki.id, name, subject, expires, max(days_left, 0), devices,
                    campaign={"kind": CA_ROLLOVER, "from_pki_id": pki.id},
                    successor_made=runtime.pki_backends.get(pki.pki_type).offers("successor_issuer"),
                )
            )  # fmt: skip
    return proposals


async def log_rollover_proposals(runtime: Runtime, now: datetime) -> None:
    """The renewal scheduler's watch over the issuers: each proposal as a warning in the log, every scan."""
    for proposal in await rollover_proposals(runtime, now):
        log.warning("CA rollover due: %s", proposal.sentence())
